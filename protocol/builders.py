"""Client builders: each request kind's friendly arguments (what `Client.<op>` and the
CLI take) made into its request Struct's fields. The kinds table (kinds.py) names each
kind's builder; its signature and docstring are the client method's."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from modelpool.protocol.fields import Structured
from modelpool.protocol.inputs import ImageLike, image_input
from modelpool.protocol.messages import ChatMessage, Sampling, ToolCall

Fields = dict[str, Any]


def embed(texts: str | list[str], model: str | None = None, *,
          dimensions: int | None = None) -> tuple[Fields, bool]:
    """float32 vectors: shape (dim,) for one text, (n, dim) for a list. `dimensions`:
    only each vector's first values, renormalised, for models trained for it
    (Matryoshka); others refuse it."""
    single = isinstance(texts, str)
    return {"model": model or "", "texts": [texts] if single else texts,
            "dimensions": dimensions}, single


def generate(prompt: str | list[dict[str, str]] | list[int], model: str | None = None, *,
             max_tokens: int | None = None, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None,
             min_p: float | None = None, presence_penalty: float | None = None,
             frequency_penalty: float | None = None,
             repetition_penalty: float | None = None,
             logit_bias: dict[int, float] | None = None, seed: int | None = None,
             stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
             min_tokens: int = 0, ignore_eos: bool = False, logprobs: int | None = None,
             prompt_logprobs: int | None = None,
             json_schema: str | dict[str, Any] | bool | None = None,
             regex: str | None = None, choice: list[str] | None = None,
             grammar: str | None = None, tools: str | list[dict[str, Any]] | None = None,
             tool_choice: Literal["none", "auto"] = "none",
             raw: bool = False, cache_salt: str = "",
             chat_template_kwargs: str | dict[str, Any] | None = None,
             reasoning_effort: str | None = None) -> tuple[Fields, bool]:
    """Stream generated text; a prompt, its token ids (given to the model as they are), or
    a chat as [{"role", "content"}, ...] (an assistant's message may hold the
    "tool_calls" it made, as ToolCalls or their dicts; a "tool" message its
    "tool_call_id").
    Temperature 0 is greedy; top_k 0 and min_p 0 leave no token out; penalties 0 (and
    repetition_penalty 1) change nothing; logit_bias adds to the logits of those token
    ids; unset, each is the model's recommendation or the daemon's default. logprobs: each
    chunk's tokens with their log-probabilities and that many likeliest alternatives
    (TextChunk.logprobs); prompt_logprobs: the prompt's tokens alike, on the last chunk.
    At most one of json_schema (a JSON Schema, as a dict or JSON text), regex, choice (one
    of these strings) and grammar (Lark or GBNF) holds the output to that language, and ends it
    where the language does. tools (OpenAI's function tools, or their JSON text) go to the
    model's chat template; with tool_choice "auto" the model may call them, in its own
    format, and the last chunk's tool_calls hold the calls it made (its finish_reason
    "tool_calls"). The worker reuses what it computed for prompts that started the same
    way (the last chunk's cached_tokens) only among requests of the same cache_salt.
    chat_template_kwargs (or their JSON text): more variables for the chat template
    (a switch such as {"enable_thinking": False}, ...); reasoning_effort ("low",
    "medium", "high", ...) for a template that reads it (others refuse it).
    Breaking out of the stream cancels it."""
    fields: Fields = {"model": model or "", "raw": raw, "sampling": _sampling(locals()),
                      "tools": _tools(tools), "tool_choice": tool_choice,
                      "cache_salt": cache_salt,
                      "chat_template_kwargs": _variables(chat_template_kwargs),
                      "reasoning_effort": reasoning_effort}
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif prompt and all(isinstance(token, int) for token in prompt):
        fields["prompt_ids"] = prompt
    else:
        fields["messages"] = [_chat_message(m) for m in prompt if isinstance(m, dict)]
    return fields, False


def _tools(tools: list[dict[str, Any]] | str | None) -> list[dict[str, Any]]:
    """Function tools, given as a list or its JSON text."""
    return msgspec.json.decode(tools) if isinstance(tools, str) else tools or []


def _variables(given: str | dict[str, Any] | None) -> dict[str, Any]:
    """The chat template's variables, given as a mapping or its JSON text."""
    return msgspec.json.decode(given) if isinstance(given, str) else given or {}


def _chat_message(message: dict[str, Any]) -> ChatMessage:
    calls = [c if isinstance(c, ToolCall) else msgspec.convert(c, ToolCall)
             for c in message.get("tool_calls") or ()]
    return ChatMessage(role=message["role"], content=message.get("content") or "",
                       tool_calls=calls, tool_call_id=message.get("tool_call_id") or "")


# Sampling's fields that generate's and describe's arguments of the same name give as they are
_AS_GIVEN = tuple(n for n in Sampling.__struct_fields__
                  if n not in ("stop", "stop_token_ids", "structured"))


def _sampling(given: dict[str, Any]) -> Sampling:
    """generate's or describe's sampling arguments (its locals) as a Sampling."""
    return Sampling(**{name: given[name] for name in _AS_GIVEN}, stop=given["stop"] or [],
                    stop_token_ids=given["stop_token_ids"] or [], structured=structured(
                        given["json_schema"], given["regex"], given["choice"],
                        given["grammar"]))


def structured(json_schema: str | dict[str, Any] | bool | None = None,
               regex: str | None = None, choice: list[str] | None = None,
               grammar: str | None = None) -> Structured | None:
    """The language a generation is held to, None for none; a schema given as a dict (or
    true or false) is sent as its JSON text."""
    if json_schema is None and regex is None and choice is None and grammar is None:
        return None
    if not isinstance(json_schema, str | None):
        json_schema = msgspec.json.encode(json_schema).decode()
    return Structured(json_schema=json_schema, regex=regex, choice=choice, grammar=grammar)


def embed_image(images: ImageLike | list[ImageLike],
                model: str | None = None) -> tuple[Fields, bool]:
    """float32 vectors: (dim,) for one image, (n, dim) for a list. An image is a path,
    bytes, a PIL image, base64 or an http(s) URL."""
    single = not isinstance(images, list)
    items = [image_input(i) for i in ([images] if single else images)]
    return {"model": model or "", "images": items}, single


def describe(image: ImageLike, query: str | list[dict[str, Any]] = "",
             model: str | None = None, *, more_images: list[ImageLike] | None = None,
             image_at: int | list[int] | None = None,
             image_offset: int | list[int] | None = None,
             tools: list[dict[str, Any]] | str | None = None,
             tool_choice: Literal["none", "auto"] = "none",
             chat_template_kwargs: str | dict[str, Any] | None = None,
             reasoning_effort: str | None = None,
             max_tokens: int | None = None, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None,
             min_p: float | None = None, presence_penalty: float | None = None,
             frequency_penalty: float | None = None,
             repetition_penalty: float | None = None,
             logit_bias: dict[int, float] | None = None, seed: int | None = None,
             stop: list[str] | None = None, stop_token_ids: list[int] | None = None,
             min_tokens: int = 0, ignore_eos: bool = False, logprobs: int | None = None,
             prompt_logprobs: int | None = None,
             json_schema: str | dict[str, Any] | bool | None = None,
             regex: str | None = None, choice: list[str] | None = None,
             grammar: str | None = None) -> tuple[Fields, bool]:
    """Stream text about an image; no query asks for a caption. The query may be a chat
    (messages as generate's, with a system message, earlier turns, ...): the image goes
    with message image_at, by default the last user's; with more_images, image_at lists
    each image's message (by default all the last user's). An image goes before its
    message's text, or image_offset characters into it (a list with more_images).
    Sampling, tools, chat_template_kwargs and reasoning_effort as generate's."""
    more = [image_input(i) for i in more_images or ()]
    fields: Fields = {"model": model or "", "image": image_input(image), "more_images": more,
                      "sampling": _sampling(locals()), "tools": _tools(tools),
                      "tool_choice": tool_choice,
                      "chat_template_kwargs": _variables(chat_template_kwargs),
                      "reasoning_effort": reasoning_effort}
    messages = [] if isinstance(query, str) else [_chat_message(m) for m in query]
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if isinstance(image_at, list):
        at = image_at
    else:
        where = image_at if image_at is not None else users[-1] if users else 0
        at = [where] * (1 + len(more))
    offsets = (image_offset if isinstance(image_offset, list)
               else [image_offset or 0] * (1 + len(more)))
    placed = {"image_at": at[0] if at else 0, "more_at": at[1:],
              "image_offset": offsets[0] if offsets else 0, "more_offsets": offsets[1:]}
    if isinstance(query, str):
        return {**fields, **placed, "prompt": query}, False
    return {**fields, **placed, "messages": messages}, False


def generate_image(prompt: str, model: str | None = None, *, steps: int | None = None,
                   width: int | None = None, height: int | None = None,
                   seed: int | None = None, guidance: float | None = None,
                   negative_prompt: str = "", preview_every: int = 0) -> tuple[Fields, bool]:
    """Progress per denoising step; the last chunk carries the PNG in .png."""
    return {"model": model or "", "prompt": prompt, "steps": steps, "width": width,
            "height": height, "seed": seed, "guidance": guidance,
            "negative_prompt": negative_prompt, "preview_every": preview_every}, False


def rerank(query: str, documents: list[str], model: str | None = None) -> tuple[Fields, bool]:
    """float32 relevance scores, one per document, in order (higher: more relevant)."""
    return {"model": model or "", "query": query, "documents": documents}, False


# ---- what the daemon checks and decides per kind ---------------------------------------


def tokenize(prompt: str | list[dict[str, Any]], model: str | None = None, *,
             raw: bool = False, tools: str | list[dict[str, Any]] | None = None,
             chat_template_kwargs: str | dict[str, Any] | None = None,
             reasoning_effort: str | None = None,
             token_strs: bool = False) -> tuple[Fields, bool]:
    """The token ids the model would read for generate's prompt (a prompt, or a chat as
    generate's, through the chat template with its tools and variables), without running
    it: .tokens, .max_model_len (its context), and with token_strs each token's text."""
    fields: Fields = {"model": model or "", "raw": raw, "tools": _tools(tools),
                      "chat_template_kwargs": _variables(chat_template_kwargs),
                      "reasoning_effort": reasoning_effort, "token_strs": token_strs}
    if isinstance(prompt, str):
        return {**fields, "prompt": prompt}, False
    return {**fields, "messages": [_chat_message(m) for m in prompt]}, False


def detokenize(tokens: list[int], model: str | None = None) -> tuple[Fields, bool]:
    """The text token ids stand for (.prompt), special tokens included."""
    return {"model": model or "", "tokens": [int(t) for t in tokens]}, False
