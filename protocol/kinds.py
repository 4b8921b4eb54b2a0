"""The one table of request kinds: what each request Struct is, for every part that
handles one.

A row says which capabilities serve the request, whether it is batched (and along which
list field it is split, coalesced and merged back by rows) or streamed, whether running
it twice gives the same answer (so identical requests may share one run), where its
images are, what the daemon checks beyond the Struct's own types, and how a client
builds it from friendly arguments. The supervisor, the workers, the client library, the
CLI and the job API all read this table; nothing else in the project lists request
kinds. Adding a capability is a row here, its Structs in messages.py, a worker adapter
and a loader.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from modelpool.protocol.inputs import ImageLike, image_input
from modelpool.protocol.messages import (
    ChatMessage,
    Chunk,
    Describe,
    Embed,
    Embeddings,
    EmbedImage,
    End,
    Error,
    Generate,
    GenerateImage,
    Image,
    ImageInput,
    ImageProgress,
    RequestDefaults,
    Rerank,
    Sampling,
    Scores,
    Structured,
    ToolCall,
    WorkRequest,
)

ReplyStyle = Literal["array", "text", "image"]  # float32 rows | text chunks | image steps
Fields = dict[str, Any]
# A client's friendly arguments -> the request's fields, and whether the caller gave one
# input where a list is also accepted (the reply is then one row, not a matrix).
Builder = Callable[..., tuple[Fields, bool]]


def _always(request: Any) -> bool:
    return True


def _no_images(request: Any) -> list[ImageInput]:
    return []


def _no_check(request: Any) -> str | None:
    return None


@dataclass(frozen=True)
class Kind:
    request: type[Any]  # the request Struct
    op: str  # its name for clients: Client.<op>, submit(op, ...), `modelpool <op>`
    served_by: tuple[str, ...]  # capabilities; a request naming no model: the first's default
    build: Builder
    final: type[Any]  # the reply that ends it successfully
    chunk: type[Any] | None = None  # the replies streamed before it, if any
    reply: ReplyStyle = "array"
    inputs: str | None = None  # batched: the list field whose items are batch units
    deterministic: Callable[[Any], bool] = _always  # after defaults are filled in
    images: Callable[[Any], list[ImageInput]] = _no_images
    with_images: Callable[[Any, list[ImageInput]], Any] | None = None
    check: Callable[[Any], str | None] = _no_check  # what the Struct's types cannot say
    # what requests that should go to the same worker share (its kept prompts), or None
    affinity: Callable[[Any], Hashable] | None = None

    @property
    def batched(self) -> bool:
        return self.inputs is not None

    @property
    def streaming(self) -> bool:
        return self.chunk is not None

    def size(self, request: Any) -> int:
        """Units of batch capacity: one per input of a batched kind, else 1."""
        return len(getattr(request, self.inputs)) if self.inputs else 1

    def split(self, request: Any, size: int) -> list[Any]:
        """Parts of at most `size` inputs, in order; each is a request of its own."""
        assert self.inputs is not None
        items = getattr(request, self.inputs)
        return [msgspec.structs.replace(request, **{self.inputs: items[i : i + size]})
                for i in range(0, len(items), size)]


def merge_rows(replies: list[Any]) -> Any:
    """The replies of a split request's parts, in order, as one reply of all their rows."""
    first = replies[0]
    merged = msgspec.structs.replace(
        first, data=b"".join(r.data for r in replies),
        shape=[sum(r.shape[0] for r in replies), *first.shape[1:]])
    if isinstance(first, Embeddings):
        merged = msgspec.structs.replace(merged, tokens=sum(r.tokens for r in replies))
    return merged


# ---- client builders: friendly arguments -> request fields ----------------------------


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
    each image's message (by default all the last user's). Sampling, tools,
    chat_template_kwargs and reasoning_effort as generate's."""
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
    placed = {"image_at": at[0] if at else 0, "more_at": at[1:]}
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


def _greedy_or_seeded(request: Generate | Describe) -> bool:
    return request.sampling.temperature == 0 or request.sampling.seed is not None


def _generate_problem(request: Generate) -> str | None:
    given = sum(map(bool, (request.prompt, request.prompt_ids, request.messages)))
    if given != 1:
        return "generate needs one of a prompt, prompt_ids or messages"
    if request.tools and (request.raw or request.prompt_ids):
        return "tools are shown to the model by its chat template: not with raw or prompt_ids"
    return _no_tools_to_call(request) or _one_language(request)


def _no_tools_to_call(request: Generate | Describe) -> str | None:
    if request.tool_choice == "auto" and not request.tools:
        return "tool_choice auto lets the model call the request's tools: it has none"
    return None


def _describe_problem(request: Describe) -> str | None:
    if request.messages and request.prompt:
        return "describe takes a question or messages, not both"
    if len(request.more_at) != len(request.more_images):
        return "more_at names the message of each of more_images"
    for at in (request.image_at, *request.more_at):
        if request.messages and (at >= len(request.messages)
                                 or request.messages[at].role != "user"):
            return (f"image_at {at}: an image goes with a user's message, and there are "
                    f"{len(request.messages)} messages")
        if not request.messages and at != 0:
            return f"image_at {at}: a question is one message (0)"
    return _no_tools_to_call(request) or _one_language(request)


def _one_language(request: Generate | Describe) -> str | None:
    """Structured output asks for one language, and ends where it does."""
    wanted = request.sampling.structured
    if wanted is None:
        return None
    given = [name for name in Structured.__struct_fields__ if getattr(wanted, name) is not None]
    if len(given) != 1:
        return ("structured output takes one of json_schema, regex, choice or grammar, "
                f"not {' and '.join(given) or 'none'}")
    if request.sampling.ignore_eos:
        return "ignore_eos with structured output: the output ends where its language does"
    if wanted.json_schema is not None:
        try:
            schema = msgspec.json.decode(wanted.json_schema)
        except msgspec.DecodeError:
            schema = None
        if not isinstance(schema, dict | bool):
            return "json_schema: a JSON Schema is a JSON object (or true or false)"
    return None


AFFINITY_CHARS = 512  # of a prompt, or of each of a chat's first two messages
AFFINITY_TOKENS = 128  # of a prompt given as token ids


def _prompt_start(request: Generate) -> Hashable:
    """What a conversation's turns share, so that its worker's prefix cache holds them:
    its first two messages (instructions and the first question), else the start of its
    prompt; and the cache salt, which keeps prompts apart anyway."""
    if request.messages:
        start: Hashable = tuple((m.role, m.content[:AFFINITY_CHARS])
                                for m in request.messages[:2])
    elif request.prompt_ids:
        start = tuple(request.prompt_ids[:AFFINITY_TOKENS])
    else:
        start = request.prompt[:AFFINITY_CHARS]
    return hash((start, request.cache_salt))


KINDS: tuple[Kind, ...] = (
    Kind(Embed, "embed", ("text_embedding", "image_embedding"), embed, Embeddings,
         inputs="texts"),
    Kind(Generate, "generate", ("text_to_text",), generate, End, Chunk, reply="text",
         deterministic=_greedy_or_seeded, check=_generate_problem, affinity=_prompt_start),
    Kind(EmbedImage, "embed_image", ("image_embedding",), embed_image, Embeddings,
         inputs="images", images=lambda r: list(r.images),
         with_images=lambda r, images: msgspec.structs.replace(r, images=images)),
    Kind(Describe, "describe", ("vision",), describe, End, Chunk, reply="text",
         deterministic=_greedy_or_seeded, check=_describe_problem,
         images=lambda r: [r.image, *r.more_images],
         with_images=lambda r, images: msgspec.structs.replace(
             r, image=images[0], more_images=images[1:])),
    Kind(GenerateImage, "generate_image", ("text_to_image",), generate_image, Image,
         ImageProgress, reply="image", deterministic=lambda r: r.seed is not None),
    Kind(Rerank, "rerank", ("rerank",), rerank, Scores, inputs="documents"),
)

KIND_OF: dict[type, Kind] = {kind.request: kind for kind in KINDS}
BY_OP: dict[str, Kind] = {kind.op: kind for kind in KINDS}
STREAMED: tuple[type, ...] = tuple({k.chunk: None for k in KINDS if k.chunk})
FINAL: tuple[type, ...] = (*{k.final: None for k in KINDS}, Error)


@dataclass(frozen=True)
class CapabilityFacts:
    kinds: tuple[Kind, ...]  # what a model of this capability serves
    batched: bool  # some of them coalesce into batches
    streaming: bool  # some of them stream
    sampled: bool  # some of them sample tokens (a `sampling` field)


def _capability(name: str) -> CapabilityFacts:
    kinds = tuple(k for k in KINDS if name in k.served_by)
    return CapabilityFacts(kinds, any(k.batched for k in kinds), any(k.streaming for k in kinds),
                           any("sampling" in k.request.__struct_fields__ for k in kinds))


CAPABILITIES: dict[str, CapabilityFacts] = {
    name: _capability(name)
    for name in dict.fromkeys(cap for kind in KINDS for cap in kind.served_by)
}


def kind_of(request: WorkRequest) -> Kind:
    return KIND_OF[type(request)]


_DEFAULTED = frozenset(RequestDefaults.__struct_fields__)
_DEFAULTABLE: dict[type, tuple[str, ...]] = {}


def with_defaults(struct: Any, defaults: RequestDefaults) -> Any:
    """The request (or a Struct inside it) with every unset parameter given the daemon's
    default; the same object when none was unset."""
    names = _DEFAULTABLE.get(type(struct))
    if names is None:
        names = tuple(n for n in struct.__struct_fields__
                      if n in _DEFAULTED or n == "sampling")
        _DEFAULTABLE[type(struct)] = names
    changes = {}
    for name in names:
        value = getattr(struct, name)
        if value is None:
            changes[name] = getattr(defaults, name)
        elif isinstance(value, msgspec.Struct):
            filled = with_defaults(value, defaults)
            if filled is not value:
                changes[name] = filled
    return msgspec.structs.replace(struct, **changes) if changes else struct


def build(op: str, *args: Any, defaults: RequestDefaults | None = None,
          **kwargs: Any) -> WorkRequest:
    """The request `client.<op>(*args, **kwargs)` would send, with the daemon's defaults
    filled in as admission would: for running a loaded model in-process (tests, benches)."""
    kind = BY_OP[op]
    fields, _ = kind.build(*args, **kwargs)
    return with_defaults(kind.request(id=0, **fields), defaults or RequestDefaults())
