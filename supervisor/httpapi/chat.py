"""The chat completions API's body as the pool's call: its messages, sampling, tools and
logprobs; a chat with images, a vision model's (its whole conversation, each image where
it was among its message's parts)."""

from __future__ import annotations

from typing import Any

from modelpool.protocol.fields import MAX_MORE_IMAGES
from modelpool.supervisor.httpapi.bodies import (
    ChatBody,
    ChatMessage,
    PoolCall,
    bad,
    image_from_url,
    sampling_kwargs,
)
from modelpool.supervisor.httpapi.tools import tool_calls


def chat_call(body: ChatBody) -> PoolCall:
    sampling = sampling_kwargs(body, body.max_completion_tokens, _chat_logprobs(body))
    made, for_tools = tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls)
    if "json_schema" in for_tools and set(sampling) & {"json_schema", "regex", "choice",
                                                       "grammar"}:
        raise bad("tool_choice", "a call holds the output to its schema: not with "
                                 "another language (response_format, structured_outputs)")
    images = [(i, offset, part) for i, m in enumerate(body.messages)
              for offset, part in _images_in(m)]
    messages = [pool_message(i, m) for i, m in enumerate(body.messages)]
    chat = {**sampling, **for_tools, "chat_template_kwargs": body.chat_template_kwargs,
            "reasoning_effort": body.reasoning_effort}
    if not images:
        return PoolCall("generate", (messages,), {**chat, "cache_salt": body.cache_salt},
                        made)
    if len(images) > 1 + MAX_MORE_IMAGES:
        raise bad("messages", f"at most {1 + MAX_MORE_IMAGES} images in a chat")
    for index, _, part in images:
        if part.image_url is None:
            raise bad(f"messages[{index}].content", "an image_url part needs image_url.url")
        if body.messages[index].role != "user":
            raise bad(f"messages[{index}].content", "an image goes in a user's message")
    inputs = [image_from_url(part.image_url.url, f"messages[{index}].content.image_url")
              for index, _, part in images]
    # The whole chat, each image where it was in its own message's text.
    return PoolCall("describe", (inputs[0], messages), {
        **chat, "more_images": inputs[1:], "image_at": [index for index, _, _ in images],
        "image_offset": [offset for _, offset, _ in images]}, made)


def _images_in(message: ChatMessage) -> list[tuple[int, Any]]:
    """A message's image parts, each with where it is in the message's text."""
    if not isinstance(message.content, list):
        return []
    found, chars = [], 0
    for part in message.content:
        if part.type == "image_url":
            found.append((chars, part))
        chars += len(part.text or "") if part.type == "text" else 0
    return found


def _chat_logprobs(body: ChatBody) -> int | None:
    """The alternatives a chat asks for beside each token's logprob, None for none."""
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise bad("logprobs", "true or false in a chat (top_logprobs: how many alternatives)")
    if not body.logprobs:
        if body.top_logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        return None
    return body.top_logprobs or 0


def pool_message(index: int, message: ChatMessage) -> dict[str, Any]:
    if message.content is None and not message.tool_calls:
        raise bad(f"messages[{index}].content", "needed, unless an assistant's message has "
                                                "tool_calls")
    if message.tool_calls and message.role != "assistant":
        raise bad(f"messages[{index}].tool_calls", "only in an assistant's message")
    out: dict[str, Any] = {"role": message.role, "content": _text_of(message)}
    if message.tool_calls:
        out["tool_calls"] = [c.for_pool() for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _text_of(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(p.text or "" for p in message.content if p.type == "text")
