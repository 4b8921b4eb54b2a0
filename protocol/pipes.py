"""Messages between the supervisor and one worker, on that worker's own pipes.

A worker's replies reuse the client reply types (Embeddings, Chunk, End, Error)
with ``id`` set to the supervisor's job id, so the supervisor forwards them by
swapping in the client's id and never needs to understand their payload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from modelpool.protocol.messages import WorkReply, WorkRequest
from modelpool.registry.spec import ModelSpec


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", omit_defaults=True):
    pass


# ---- supervisor -> worker ---------------------------------------------------------


class ImagePolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits on image input; the config's [images] table, shipped to every worker."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    # All images of one request, decoded; a batch is also cut into forward passes of at
    # most max_pixels, so a worker never holds more than about that many decoded.
    max_request_pixels: int = 160_000_000
    allow_urls: bool = False  # fetch http(s) image URLs (public addresses only)
    url_timeout_s: float = 10.0
    url_max_redirects: int = 3


class SharedBytes(msgspec.Struct, frozen=True, array_like=True):
    """Image bytes the supervisor placed in POSIX shared memory, not in the message."""

    name: str
    size: int


class WorkItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    job_id: int
    request: WorkRequest
    shared: list[SharedBytes | None] = []  # per image of the request, when moved to shm


class Work(_Msg, frozen=True, kw_only=True, tag="work"):
    # Several for batchable capabilities (one batch), and for a worker that batches its
    # streams continuously (one item per slot it granted).
    items: list[WorkItem]
    threads: int = 0  # intra-op threads for this work (cores idle siblings leave); 0: keep


class Abort(_Msg, frozen=True, kw_only=True, tag="abort"):
    job_id: int  # stop this job soon; the worker ends it with End(finish_reason="cancelled")


class Shutdown(_Msg, frozen=True, kw_only=True, tag="shutdown"):
    pass


class Threads(_Msg, frozen=True, kw_only=True, tag="threads"):
    """Intra-op threads for the forward passes from the next on, while streams run: the
    cores a stream's idle siblings left it change as they start and finish work."""

    count: int


ToWorker = Work | Abort | Shutdown | Threads


# ---- shared weights: a holder's tensors, mapped by the serving workers -------------

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory segments, by name


class CpuStorage(msgspec.Struct, frozen=True, tag="cpu", array_like=True):
    """A storage's bytes at offset_bytes in the holder's shared-memory segment."""

    offset_bytes: int
    nbytes: int


class CudaStorage(msgspec.Struct, frozen=True, tag="cuda", array_like=True):
    """A CUDA IPC handle, the fields of torch's UntypedStorage._share_cuda_()."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class SharedTensor(msgspec.Struct, frozen=True, array_like=True):
    """One parameter or buffer: `path` is "<module>/<dotted name>"; a view of a storage."""

    path: str
    buffer: bool
    storage: int  # index into SharedWeights.storages
    offset: int  # in elements of dtype, into the storage
    shape: list[int]
    stride: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"


class SharedWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Every tensor of a loaded model as the holder shares it: tied weights share a
    storage, so they stay tied in the workers."""

    segment: str | None = None  # POSIX shm name of the CPU storages
    segment_bytes: int = 0
    storages: list[CpuStorage | CudaStorage] = []
    tensors: list[SharedTensor] = []


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker is told when it starts: the supervisor -> worker contract."""

    worker_id: int
    spec: ModelSpec  # with its device resolved ("cpu" or "cuda:N")
    threads: int = 0  # torch intra-op threads; 0: torch's default
    max_batch: int = 32
    heartbeat_interval_s: float = 0.5
    idle_load_s: float = 1.0  # then a load that is still running leaves idle priority
    images: ImagePolicy = msgspec.field(default_factory=ImagePolicy)
    # Set for a weights holder: load, share the weights (CPU ones in this shared-memory
    # segment), never serve.
    hold_segment: str | None = None
    weights: SharedWeights | None = None  # a serving worker maps its holder's weights


# ---- worker -> supervisor ---------------------------------------------------------


class Ready(_Msg, frozen=True, kw_only=True, tag="ready"):
    pid: int
    load_s: float
    uss_mb: float | None = None  # private memory after loading
    weights_mb: float | None = None  # size of the weight files (shared by all workers)
    vram_mb: float | None = None  # GPU memory reserved after loading, on a GPU
    info: dict[str, Any] = {}  # capability facts, e.g. {"dim": 384} or {"context": 2048}
    weights: SharedWeights | None = None  # from a weights holder: what workers will map


def token_limit(info: dict[str, Any]) -> int | None:
    """The most tokens the model looks at, as its loader reports it in Ready.info (None:
    unknown): the workers cut texts by it, and the supervisor lists it."""
    for key in ("max_seq_length", "max_length", "context"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


class LoadFailed(_Msg, frozen=True, kw_only=True, tag="load_failed"):
    cause: str


class ExportFirst(_Msg, frozen=True, kw_only=True, tag="export_first"):
    """The worker's model must run an ONNX export not made yet (execution = "onnx"): it
    leaves the making to the daemon, within the memory budget, and exits."""

    entry: str  # the export's cache entry
    model_dir: str  # the model's files


class WantWork(_Msg, frozen=True, kw_only=True, tag="want_work"):
    """A grant of `slots` more units of work: a one-at-a-time worker grants 1 each time
    it is free (one Work, whatever its batch); a worker that batches streams grants one
    per free sequence, at the start and as streams end, and each stream takes one."""

    slots: int = 1


class Replies(_Msg, frozen=True, kw_only=True, tag="replies"):
    """A Work's final replies, in one message: a batch of 32 read and decoded as one
    frame, not 32 (~5% of the supervisor's time a no-op request)."""

    items: list[WorkReply]


FromWorker = Ready | LoadFailed | ExportFirst | WantWork | Replies | WorkReply


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    seq: int
    progress: int  # advanced per batch, token or diffusion step
    tokens: int = 0  # generated since the worker started, for tokens/s
    threads: int = 0  # intra-op threads its forward passes use now; 0: not known yet


to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
