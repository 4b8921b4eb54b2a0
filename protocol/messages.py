"""The messages on the client socket: tagged msgspec Structs (the job API's are in
protocol/jobs.py; the one Union per direction and its decoder in protocol/wire.py).

Requests carry a client-chosen ``id``; every reply carries it back, so one
connection multiplexes many requests. A request ends with exactly one final
reply: ``Embeddings``, ``End``, ``Error`` or a management reply.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.fields import (
    MAX_MORE_IMAGES,
    MAX_TEXTS,
    MAX_TOKENS,
    Capability,
    Guidance,
    ImageSide,
    Place,
    Places,
    PositiveSeconds,
    Priority,
    Sampling,
    Steps,
    TemplateVariables,
    TokenId,
    Tools,
)
from modelpool.protocol.status import PoolStatus

PROTOCOL_VERSION = 1



class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", omit_defaults=True):
    pass


class _Request(_Msg, frozen=True, kw_only=True):
    id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    model: str = ""  # "" asks for the default model of the capability
    priority: Priority = "normal"
    timeout_s: PositiveSeconds | None = None  # None: the daemon's default
    deadline_s: PositiveSeconds | None = None  # seconds from sending; expired work never runs
    sent_at: float | None = None  # the client's time.time() at sending, for deadline_s
    # Requests naming one tenant take one turn among their user's clients, whatever their
    # connection (the HTTP front door names each API key's); "": the connection's own.
    tenant: Annotated[str, msgspec.Meta(max_length=64)] = ""


# ---- client -> daemon -------------------------------------------------------------


class Hello(_Msg, frozen=True, kw_only=True, tag="hello"):
    protocol_version: int
    client: str = ""


class Embed(_Request, frozen=True, kw_only=True, tag="embed"):
    texts: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_TEXTS)]
    # Matryoshka models: each vector's first `dimensions` values (renormalised when the
    # model's are unit length). None: the model's own size.
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A call of one of the request's tools: its name and arguments (JSON text)."""

    name: str
    arguments: str
    id: str = ""  # in a conversation: the id the tool's answer (a "tool" message) gives


class CallDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A piece of a tool call as the model writes it (tool_choice "auto"): a call's first
    piece names it and gives its id; each adds to its arguments' JSON text. A stream's
    pieces of a call, joined, are End.tool_calls[index]."""

    index: int  # the call's, among the answer's calls
    arguments: str = ""
    name: str = ""  # the call's first piece only
    id: str = ""  # the call's first piece only


def new_call_id() -> str:
    """A tool call's id in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str
    content: str
    tool_calls: Annotated[list[ToolCall], msgspec.Meta(max_length=128)] = []  # an assistant's
    tool_call_id: str = ""  # a "tool" message: the call it answers


Effort = Literal["none", "minimal", "low", "medium", "high"]


class Generate(_Request, frozen=True, kw_only=True, tag="generate"):
    prompt: str = ""
    messages: list[ChatMessage] = []
    # a prompt as token ids, given to the model as they are (an evaluation harness's)
    prompt_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)] = []
    raw: bool = False  # True: send the prompt as-is, without the model's chat template
    # function tools in OpenAI's shape ({"type": "function", "function": {...}}), shown to
    # the model by its chat template
    tools: Tools = []
    # "auto": the model may call them, in its own format (its chat template's): the calls
    # are read out of its output and come in End.tool_calls, not as text
    tool_choice: Literal["none", "auto"] = "none"
    # more variables for the chat template (vLLM's chat_template_kwargs: a template's
    # switches, such as enable_thinking)
    chat_template_kwargs: TemplateVariables = {}
    # OpenAI's reasoning_effort, for a template that reads that variable
    reasoning_effort: Effort | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    # the worker's kept prompts (prefix caching) are shared only among requests of the same
    # salt: clients that must not learn from each other's timing or cached_tokens differ
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] = ""


class ImageInput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One image: its encoded bytes (PNG, JPEG, ...) or an http(s) URL the daemon may
    fetch when its config allows. Decoded only inside a worker."""

    data: bytes | None = None
    url: str | None = None


class EmbedImage(_Request, frozen=True, kw_only=True, tag="embed_image"):
    images: Annotated[list[ImageInput], msgspec.Meta(min_length=1, max_length=1024)]


class Describe(_Request, frozen=True, kw_only=True, tag="describe"):
    image: ImageInput
    prompt: str = ""  # the question; "" asks for a caption
    # or a chat (system, earlier turns, ...), the image in its message `image_at` (a
    # user's), `image_offset` characters into its text
    messages: list[ChatMessage] = []
    image_at: Place = 0
    image_offset: Place = 0
    # a chat's other images, in order, each in its message (more_at[i]) at its offset
    more_images: Annotated[list[ImageInput], msgspec.Meta(max_length=MAX_MORE_IMAGES)] = []
    more_at: Places = []
    more_offsets: Places = []
    # function tools, whether the model may call them, the template's variables and
    # reasoning_effort: as Generate's
    tools: Tools = []
    tool_choice: Literal["none", "auto"] = "none"
    chat_template_kwargs: TemplateVariables = {}
    reasoning_effort: Effort | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)


class GenerateImage(_Request, frozen=True, kw_only=True, tag="generate_image"):
    prompt: str
    negative_prompt: str = ""
    steps: Steps | None = None  # None here and below: the daemon's default
    width: ImageSide | None = None
    height: ImageSide | None = None
    seed: int | None = None
    guidance: Guidance | None = None
    preview_every: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: no previews


class Rerank(_Request, frozen=True, kw_only=True, tag="rerank"):
    """How relevant each document is to the query: one score per document, in order."""

    query: str
    documents: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_TEXTS)]


class Tokenize(_Request, frozen=True, kw_only=True, tag="tokenize"):
    """A generate request's prompt as its model reads it, not run: its token ids (vLLM's
    /tokenize). The fields that make a generate request's prompt, alike."""

    prompt: str = ""
    messages: list[ChatMessage] = []
    raw: bool = False
    tools: Tools = []
    chat_template_kwargs: TemplateVariables = {}
    reasoning_effort: Effort | None = None
    token_strs: bool = False  # each token's text too, as the tokenizer writes it


class Detokenize(_Request, frozen=True, kw_only=True, tag="detokenize"):
    """Token ids into the text they stand for, special tokens included (vLLM's
    /detokenize)."""

    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]


class Cancel(_Msg, frozen=True, kw_only=True, tag="cancel"):
    id: int  # the id of the request to cancel


class GetStatus(_Msg, frozen=True, kw_only=True, tag="status"):
    id: int


class ListModels(_Msg, frozen=True, kw_only=True, tag="models"):
    id: int


class LoadModel(_Msg, frozen=True, kw_only=True, tag="load"):
    id: int
    model: str
    workers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1


class UnloadModel(_Msg, frozen=True, kw_only=True, tag="unload"):
    id: int
    model: str


class StopDaemon(_Msg, frozen=True, kw_only=True, tag="stop"):
    id: int


class ReloadConfig(_Msg, frozen=True, kw_only=True, tag="reload"):
    """Read the config file again and apply its models (supervisor/reload.py)."""

    id: int


WorkRequest = (Embed | Generate | EmbedImage | Describe | GenerateImage | Rerank | Tokenize
               | Detokenize)
# The control messages beside the work requests; every message a client may send is in
# protocol/wire.py's ClientMessage.
ControlRequest = (Cancel | GetStatus | ListModels | LoadModel | UnloadModel | StopDaemon
                  | ReloadConfig)


# ---- daemon -> client -------------------------------------------------------------


class Welcome(_Msg, frozen=True, kw_only=True, tag="welcome"):
    protocol_version: int
    server_version: str
    max_frame_bytes: int
    default_models: dict[str, str] = {}  # capability -> model key


class Embeddings(_Msg, frozen=True, kw_only=True, tag="embeddings"):
    id: int
    data: bytes  # raw little-endian float32, row-major
    shape: list[int]
    dtype: str = "float32"
    model: str = ""
    tokens: int = 0  # input tokens the model read (usage figures); 0 when it cannot say


class Scores(_Msg, frozen=True, kw_only=True, tag="scores"):
    """The final reply of rerank: one relevance score per document, in request order."""

    id: int
    data: bytes  # raw little-endian float32
    shape: list[int]  # [number of documents]
    dtype: str = "float32"
    model: str = ""


class Tokenized(_Msg, frozen=True, kw_only=True, tag="tokenized"):
    """The final reply of tokenize."""

    id: int
    tokens: list[int]
    token_strs: list[str] | None = None
    max_model_len: int = 0  # the model's context: its prompt's and output's tokens together
    model: str = ""


class Detokenized(_Msg, frozen=True, kw_only=True, tag="detokenized"):
    id: int
    prompt: str
    model: str = ""


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token: str  # as the tokenizer decodes it alone
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token: its text, id and log-probability, and the likeliest tokens at its
    place (as many as the request asked, likeliest first). A prompt's first token has
    none (None, and no alternatives): nothing before it predicts it."""

    token: str
    token_id: int
    logprob: float | None
    top: list[TopLogprob] = []


class Chunk(_Msg, frozen=True, kw_only=True, tag="chunk"):
    """Text of a stream; with logprobs asked for, the tokens made since the last chunk
    (their text may still be held back by a stop string, or cut by one: then the
    chunk's text is "")."""

    id: int
    seq: int
    text: str
    # a reasoning model's thinking made since the last chunk, kept apart from its answer
    # (`text`); "" for a model that does not reason
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None
    calls: list[CallDelta] | None = None  # tool calls' pieces (tool_choice "auto")


class End(_Msg, frozen=True, kw_only=True, tag="end"):
    id: int
    # "stop" (eos or stop string) | "length" | "cancelled" | "tool_calls" (it made calls)
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, whose keys and values were kept (reused)
    completion_tokens: int = 0
    model: str = ""
    prompt_logprobs: list[TokenLogprob] | None = None  # with prompt_logprobs asked for
    tool_calls: list[ToolCall] | None = None  # with tool_choice "auto": the calls it made
    reasoning_tokens: int = 0  # of completion_tokens, a reasoning model's thinking


class ImageProgress(_Msg, frozen=True, kw_only=True, tag="image_progress"):
    id: int
    seq: int
    step: int
    total_steps: int
    preview_png: bytes | None = None  # a low-resolution preview, when asked for


class Image(_Msg, frozen=True, kw_only=True, tag="image"):
    """The final reply of generate_image."""

    id: int
    png: bytes
    width: int
    height: int
    seed: int
    model: str = ""


class Error(_Msg, frozen=True, kw_only=True, tag="error"):
    id: int | None  # None: the frame could not be tied to a request
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    capability: Capability
    aliases: list[str]
    source: str
    default: bool
    state: str
    context: int | None = None  # the tokens it sees, once one of its workers has loaded it


class StatusReply(_Msg, frozen=True, kw_only=True, tag="status_reply"):
    id: int
    status: PoolStatus


class ModelsReply(_Msg, frozen=True, kw_only=True, tag="models_reply"):
    id: int
    models: list[ModelInfo]


class Ack(_Msg, frozen=True, kw_only=True, tag="ack"):
    id: int
    message: str = ""


# What answers a WorkRequest: streamed chunks, then one final reply. Workers send these
# up their pipes too, under the supervisor's job id.
WorkReply = (Embeddings | Scores | Chunk | End | ImageProgress | Image | Tokenized
             | Detokenized | Error)
ControlReply = StatusReply | ModelsReply | Ack

encoder = msgspec.msgpack.Encoder()  # built once: cheap to call, costly to build


def to_builtins(obj: Any) -> Any:
    """Plain dicts and lists for JSON output (status --json)."""
    return msgspec.to_builtins(obj)
