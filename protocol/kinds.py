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

from modelpool.protocol.builders import (
    Fields,
    describe,
    detokenize,
    embed,
    embed_image,
    generate,
    generate_image,
    rerank,
    tokenize,
)
from modelpool.protocol.fields import RequestDefaults, Structured
from modelpool.protocol.messages import (
    Chunk,
    Describe,
    Detokenize,
    Detokenized,
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
    Rerank,
    Scores,
    Tokenize,
    Tokenized,
    WorkRequest,
)

# float32 rows | text chunks | image steps | the final reply itself
ReplyStyle = Literal["array", "text", "image", "message"]
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


def _greedy_or_seeded(request: Generate | Describe) -> bool:
    return request.sampling.temperature == 0 or request.sampling.seed is not None


def _generate_problem(request: Generate) -> str | None:
    given = sum(map(bool, (request.prompt, request.prompt_ids, request.messages)))
    if given != 1:
        return "generate needs one of a prompt, prompt_ids or messages"
    if request.tools and (request.raw or request.prompt_ids):
        return "tools are shown to the model by its chat template: not with raw or prompt_ids"
    return _no_tools_to_call(request) or _one_language(request)


def _tokenize_problem(request: Tokenize) -> str | None:
    if bool(request.prompt) == bool(request.messages):
        return "tokenize needs a prompt or messages (one of them)"
    if request.tools and request.raw:
        return "tools are shown to the model by its chat template: not with raw"
    return None


def _no_tools_to_call(request: Generate | Describe) -> str | None:
    if request.tool_choice == "auto" and not request.tools:
        return "tool_choice auto lets the model call the request's tools: it has none"
    return None


def _describe_problem(request: Describe) -> str | None:
    if request.messages and request.prompt:
        return "describe takes a question or messages, not both"
    if len(request.more_images) != len(request.more_at) or \
            len(request.more_offsets) not in (0, len(request.more_images)):
        return "more_at (and more_offsets) place each of more_images"
    offsets = request.more_offsets or [0] * len(request.more_at)
    for at, offset in zip((request.image_at, *request.more_at),
                          (request.image_offset, *offsets), strict=True):
        if request.messages and (at >= len(request.messages)
                                 or request.messages[at].role != "user"):
            return (f"image_at {at}: an image goes with a user's message, and there are "
                    f"{len(request.messages)} messages")
        if not request.messages and at != 0:
            return f"image_at {at}: a question is one message (0)"
        text = request.messages[at].content if request.messages else request.prompt
        if offset > len(text):
            return f"image_offset {offset}: past the end of its message's text"
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
    Kind(Tokenize, "tokenize", ("text_to_text",), tokenize, Tokenized, reply="message",
         check=_tokenize_problem),
    Kind(Detokenize, "detokenize", ("text_to_text",), detokenize, Detokenized,
         reply="message"),
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
