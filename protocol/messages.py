"""The messages on the client socket: tagged msgspec Structs (the job API's are in
protocol/jobs.py; the one Union per direction and its decoder in protocol/wire.py).

Requests carry a client-chosen ``id``; every reply carries it back, so one
connection multiplexes many requests. A request ends with exactly one final
reply: ``Embeddings``, ``End``, ``Error`` or a management reply.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.totals import ModelTotals

PROTOCOL_VERSION = 1

Priority = Literal["critical", "high", "normal", "low", "batch"]
PRIORITIES: tuple[Priority, ...] = ("critical", "high", "normal", "low", "batch")
Capability = str  # a capability named in protocol/kinds.py, e.g. "text_embedding"

MAX_TEXTS = 4096
MAX_TOKENS = 1 << 20
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Steps = Annotated[int, msgspec.Meta(ge=1, le=1000)]
IMAGE_SIDE_MIN, IMAGE_SIDE_MAX, IMAGE_SIDE_STEP = 8, 4096, 8  # pixels
ImageSide = Annotated[int, msgspec.Meta(ge=IMAGE_SIDE_MIN, le=IMAGE_SIDE_MAX,
                                        multiple_of=IMAGE_SIDE_STEP)]
Stops = Annotated[list[str], msgspec.Meta(max_length=16)]
Guidance = Annotated[float, msgspec.Meta(ge=0, le=100)]
TOP_K_MAX = 2**31 - 1  # any k at least the vocabulary is all of it
TopK = Annotated[int, msgspec.Meta(ge=0, le=TOP_K_MAX)]
MinP = Annotated[float, msgspec.Meta(ge=0, le=1)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", omit_defaults=True):
    pass


class _Request(_Msg, frozen=True, kw_only=True):
    id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    model: str = ""  # "" asks for the default model of the capability
    priority: Priority = "normal"
    timeout_s: PositiveSeconds | None = None  # None: the daemon's default
    deadline_s: PositiveSeconds | None = None  # seconds from sending; expired work never runs
    sent_at: float | None = None  # the client's time.time() at sending, for deadline_s


# ---- client -> daemon -------------------------------------------------------------


class Hello(_Msg, frozen=True, kw_only=True, tag="hello"):
    protocol_version: int
    client: str = ""


class Embed(_Request, frozen=True, kw_only=True, tag="embed"):
    texts: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_TEXTS)]


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    content: str


class Sampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How generate and describe pick their tokens. None: the model's recommendation
    (its generation_config.json), else the daemon's configured default (RequestDefaults),
    filled in when the request is admitted."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] | None = None  # 0: greedy
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: TopK | None = None  # the k likeliest tokens only; 0: all
    min_p: MinP | None = None  # tokens below min_p x the likeliest's probability: out
    seed: int | None = None  # None: a random seed per request
    stop: Stops = []  # cut from the output
    ignore_eos: bool = False


class Generate(_Request, frozen=True, kw_only=True, tag="generate"):
    prompt: str = ""
    messages: list[ChatMessage] = []
    raw: bool = False  # True: send the prompt as-is, without the model's chat template
    sampling: Sampling = msgspec.field(default_factory=Sampling)


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


class RequestDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a request gets for a parameter its client left unset: the daemon's
    [defaults] table. The only place these values are written."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] = 256
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    steps: Steps = 25
    width: ImageSide = 512
    height: ImageSide = 512
    guidance: Guidance = 7.5


class Rerank(_Request, frozen=True, kw_only=True, tag="rerank"):
    """How relevant each document is to the query: one score per document, in order."""

    query: str
    documents: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_TEXTS)]


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


WorkRequest = Embed | Generate | EmbedImage | Describe | GenerateImage | Rerank
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


class Chunk(_Msg, frozen=True, kw_only=True, tag="chunk"):
    id: int
    seq: int
    text: str


class End(_Msg, frozen=True, kw_only=True, tag="end"):
    id: int
    finish_reason: str  # "stop" (eos or stop string) | "length" | "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""


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


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: int
    pid: int | None
    state: str  # starting | loading | idle | busy | holding | stopping
    inflight: int
    started_s_ago: float
    idle_s: float | None
    uss_mb: float | None
    last_heartbeat_s: float | None
    load_s: float | None = None
    holds_weights: bool = False  # the model's weights holder: it serves nothing
    # A generation worker that batches its streams: how many it runs now, and at most.
    sequences: int | None = None
    max_sequences: int | None = None
    tokens_per_s: float | None = None  # generated, over the last seconds
    threads: int | None = None  # intra-op threads its forward passes use now (heartbeats)
    replacing: str | None = None  # why a new worker takes its place once one has loaded
    late: bool = False  # silent for four heartbeats: given no new work until it beats
    info: dict[str, Any] = {}  # what its loaded model says of itself (dim, execution, ...)


class PriorityStats(msgspec.Struct, frozen=True, kw_only=True):
    priority: Priority
    queued: int
    running: int
    completed: int
    failed: int
    expired: int
    deduplicated: int
    rejected: dict[str, int]  # by error code
    p50_ms: float | None
    p99_ms: float | None


class ModelStatus(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    capability: Capability
    state: str  # cold | loading | ready | failed | draining
    queued: int
    running: int
    completed: int
    failed: int
    workers: list[WorkerStatus]
    last_error: str | None = None
    memory_mb: float = 0.0  # charged against the budget: weights once + each worker
    health: str = "ok"  # or why not (failed loads, hung or silent workers)
    priorities: list[PriorityStats] = []  # only priorities that have seen traffic
    mean_batch: float = 0.0
    device: str | None = None  # "cpu" or "cuda:N"; None: the asked device is missing
    totals: ModelTotals | None = None
    tokens_per_s: float | None = None  # generated by all its workers, over the last seconds
    tokens: int = 0  # generated by its live workers since they started
    loading: str | None = None  # while a worker loads: "downloading: N MiB so far" or weights
    export_waits_for_mb: float | None = None  # its ONNX export's expected peak, while the
    # memory budget has no room for it (eager PyTorch serves meanwhile)
    exporting: bool = False  # its ONNX export is being made in the background
    recommended: dict[str, Any] = {}  # sampling its generation_config.json recommends


class DeviceMemory(msgspec.Struct, frozen=True, kw_only=True):
    device: str
    budget_mb: float
    used_mb: float
    total_mb: float


class MemoryStatus(msgspec.Struct, frozen=True, kw_only=True):
    budget_mb: float
    used_mb: float
    total_mb: float
    available_mb: float
    gpus: list[DeviceMemory] = []


class ModelLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One model on one daemon of a cluster, as that daemon reports it."""

    live: int = 0  # workers, loading ones included
    ready: int = 0
    idle: int = 0
    queued: int = 0  # requests waiting in its queue there


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    beat_s_ago: float
    models: dict[str, ModelLoad] = {}
    running_jobs: int = 0
    # The models it could run now (device, files, memory); None: a node that does not say.
    runnable: list[str] | None = None


class ClusterStatus(msgspec.Struct, frozen=True, kw_only=True):
    node: str  # this daemon's name
    reachable: bool  # its PostgreSQL answers
    nodes: list[NodeStatus] = []  # the live ones
    queued_jobs: dict[str, int] = {}  # waiting in the shared queue, by model
    # Models with jobs waiting that no live node can run: seconds until those jobs end
    # (None: they wait for such a node however long).
    stranded: dict[str, float | None] = {}
    # Models that live nodes configure otherwise than this one (source, loader, options):
    # by key, those nodes.
    differs: dict[str, list[str]] = {}


class ClientsStatus(msgspec.Struct, frozen=True, kw_only=True):
    connections: int
    max_connections: int
    unread_reply_bytes: int  # replies written to clients that have not taken them yet
    max_unread_total_bytes: int


class PoolStatus(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    version: str
    uptime_s: float
    socket: str
    shutting_down: bool
    models: list[ModelStatus]
    memory: MemoryStatus
    cluster: ClusterStatus | None = None  # when daemons share a PostgreSQL queue
    clients: ClientsStatus | None = None  # filled in by the server, which owns connections


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
WorkReply = Embeddings | Scores | Chunk | End | ImageProgress | Image | Error
ControlReply = StatusReply | ModelsReply | Ack

encoder = msgspec.msgpack.Encoder()  # built once: cheap to call, costly to build


def to_builtins(obj: Any) -> Any:
    """Plain dicts and lists for JSON output (status --json)."""
    return msgspec.to_builtins(obj)
