"""vLLM's /tokenize and /detokenize: a prompt's token ids as the model reads them (a
completion's prompt alone, its special tokens added; a chat's messages, through its chat
template with the body's tools and variables), and token ids back into text. The worker
that runs the model makes them (workers/capabilities/tokens.py); this only shapes the
bodies and answers."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from modelpool.protocol.fields import MAX_TOKENS, TokenId
from modelpool.protocol.messages import Detokenized, Effort, Tokenized
from modelpool.supervisor.httpapi.bodies import (
    ChatMessage,
    Options,
    PoolCall,
    Refused,
    bad,
    options,
    refuse_unsupported,
    refused_note,
)
from modelpool.supervisor.httpapi.chat import pool_message
from modelpool.supervisor.httpapi.tools import Tools

NOT_SUPPORTED = "not supported: the prompt is read as generating it would read it"


class TokenizeBody(Options, kw_only=True):
    """A completion's `prompt` or a chat's `messages`, as vLLM takes them."""

    model: str = ""
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    tools: Tools | None = None
    chat_template_kwargs: Annotated[dict[str, Any], msgspec.Meta(max_length=32)] | None = None
    reasoning_effort: Effort | None = None
    return_token_strs: bool = False
    # vLLM's defaults, which generating uses: a prompt's special tokens added, a chat's
    # written by its template, which ends in the assistant's opening
    add_special_tokens: bool | None = None
    add_generation_prompt: Annotated[bool, refused_note("true only")] = True
    continue_final_message: Annotated[bool, refused_note("false only")] = False
    chat_template: Annotated[str | None, refused_note("the model's own only")] = None
    refused: ClassVar[Refused] = {
        "add_generation_prompt": ((True,), NOT_SUPPORTED),
        "continue_final_message": ((False,), NOT_SUPPORTED),
        "chat_template": ((None,), "not supported: the model's own template is used"),
    }


class DetokenizeBody(Options, kw_only=True):
    model: str = ""
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]


class TokenIdsAnswer(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int  # the model's context: prompt and output tokens together
    tokens: list[int]
    token_strs: list[str] | None = None


class TextAnswer(msgspec.Struct, kw_only=True):
    prompt: str


def tokenize_call(body: TokenizeBody) -> PoolCall:
    refuse_unsupported(body)
    if (body.prompt is None) == (body.messages is None):
        raise bad("prompt", "send a prompt or messages (one of them)")
    common = {"model": body.model or None, "token_strs": body.return_token_strs,
              **options(body)}
    if body.messages is None:
        if body.add_special_tokens is False or body.tools or body.chat_template_kwargs:
            raise bad("add_special_tokens" if body.add_special_tokens is False else "prompt",
                      "a prompt is read alone, its special tokens added; send messages for "
                      "the chat template")
        return PoolCall("tokenize", (body.prompt,), {**common, "raw": True})
    if body.add_special_tokens:
        raise bad("add_special_tokens", "a chat's special tokens are its template's")
    for index, message in enumerate(body.messages):
        if isinstance(message.content, list) and any(p.type != "text" for p in message.content):
            raise bad(f"messages[{index}].content", "text only: an image's tokens are its "
                      "vision model's")
    return PoolCall("tokenize", ([pool_message(i, m) for i, m in enumerate(body.messages)],), {
        **common, "tools": [msgspec.to_builtins(t) for t in body.tools or ()],
        "chat_template_kwargs": body.chat_template_kwargs,
        "reasoning_effort": body.reasoning_effort})


def detokenize_call(body: DetokenizeBody) -> PoolCall:
    return PoolCall("detokenize", (body.tokens,), {"model": body.model or None,
                                                   **options(body)})


def tokenize_answer(reply: Tokenized) -> TokenIdsAnswer:
    return TokenIdsAnswer(count=len(reply.tokens), max_model_len=reply.max_model_len,
                            tokens=reply.tokens, token_strs=reply.token_strs)


def detokenize_answer(reply: Detokenized) -> TextAnswer:
    return TextAnswer(prompt=reply.prompt)
