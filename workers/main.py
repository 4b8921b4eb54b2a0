"""The worker process: load one model, say Ready, then ask for work, run it, reply.

Started by the supervisor from a forkserver. Talks only through typed msgspec
messages on two sockets: the duplex work pipe and the one-way heartbeat pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import FrameTooLarge, frame, recv_frame, send_frame
from modelpool.protocol.kinds import STREAMED, kind_of
from modelpool.protocol.messages import encoder
from modelpool.protocol.pipes import (
    Abort,
    ExportFirst,
    Heartbeat,
    ImagePolicy,
    LoadFailed,
    Ready,
    Replies,
    SharedWeights,
    Shutdown,
    Threads,
    WantWork,
    Work,
    WorkerSettings,
    WorkItem,
    to_worker_decoder,
)
from modelpool.workers import exitcodes, priority
from modelpool.workers.progress import load_progress

if TYPE_CHECKING:
    from modelpool.workers.streams import Plan

IDLE_TRIM_S = 1.0  # idle this long after work: return freed memory to the OS
WANT_WORK = frame(encoder.encode(WantWork()))  # the same bytes after every Work


class Worker:
    """The Outbox the capability adapters write to; owns the work pipe on the worker side."""

    def __init__(self, sock: socket.socket, images: ImagePolicy | None = None) -> None:
        self.sock = sock
        self.images = images or ImagePolicy()
        self.progress = 0
        self.tokens = 0  # generated so far, for the supervisor's tokens/s
        self.image_bytes: dict[tuple[int, int], bytes] = {}  # (job id, index) -> bytes
        self.loaded = False  # until then the heartbeat reports load progress
        self.aborts: set[int] = set()
        self.stopping = False
        # While a Work runs, its final replies wait for its end (finish_work) and leave
        # as one Replies, in one write after its WantWork; streamed chunks go at once.
        self.held: list[Any] | None = None
        # Intra-op threads: what the forward passes use now (0: as loaded), what the
        # supervisor granted last, and how this worker's model changes its count.
        self.threads = 0
        self.threads_wanted = 0
        self.set_model_threads: Callable[[int], bool] | None = None

    def send(self, msg: msgspec.Struct) -> None:
        if self.held is not None and not isinstance(msg, STREAMED):
            self.held.append(msg)
            return
        self._write(frame(encoder.encode(msg)))

    def finish_work(self) -> None:
        """A WantWork and the Work's final replies, in one write, the WantWork first.
        Sent apart, the supervisor could pass a reply on, and the client send its next
        request, before this worker's WantWork came: the request then went to a sibling,
        whose threads and caches had gone cold (a lone client of eager MiniLM alternated
        between two workers 47 times in 200 requests). First, it lets the supervisor send
        the next waiting batch before it passes these replies on: this worker runs it
        meanwhile (no-op requests at 64 in flight ~8% faster)."""
        held, self.held = self.held, None
        self._write(WANT_WORK + frame(encoder.encode(Replies(items=held))) if held
                    else WANT_WORK)

    def _write(self, data: bytes) -> None:
        if self.held:  # a chunk after held replies: keep the order they were sent in
            data, self.held = frame(encoder.encode(Replies(items=self.held))) + data, []
        try:
            self.sock.sendall(data)
        except OSError:
            os._exit(exitcodes.SUPERVISOR_GONE)

    def tick(self, tokens: int = 0) -> None:
        self.progress += 1
        self.tokens += tokens

    def aborted(self, job_id: int) -> bool:
        # Drain what the supervisor sent while we were busy: Abort, Shutdown, Threads.
        while select.select([self.sock], [], [], 0)[0]:
            self._handle_control(self.receive())
        self.use_threads()
        return job_id in self.aborts or self.stopping

    def use_threads(self) -> None:
        """The last grant (a Work's or a Threads message's), for the next forward pass:
        several that came together cost one change (torch's takes ~1 ms)."""
        wanted = self.threads_wanted
        if wanted and wanted != self.threads and self.set_model_threads is not None:
            if self.set_model_threads(wanted):
                self.threads = wanted
            else:
                self.threads_wanted = 0  # a model without intra-op threads to set

    def take_images(self, items: list[WorkItem]) -> None:
        """Copy in the images the supervisor put in shared memory for this work, and
        unlink their segments, before any of it runs."""
        self.image_bytes = {}
        if not any(item.shared for item in items):
            return  # most work: no images (and no import to look up for each)
        from modelpool.workers.capabilities import images

        for item in items:
            for index, shared in enumerate(item.shared):
                if shared is not None:
                    with contextlib.suppress(OSError):  # gone: image_data says so
                        self.image_bytes[(item.job_id, index)] = images.take_shared(
                            shared.name, shared.size)

    def image_data(self, item: WorkItem, index: int) -> bytes:
        from modelpool.workers.capabilities import images

        source = kind_of(item.request).images(item.request)[index]
        if index < len(item.shared) and item.shared[index] is not None:
            data = self.image_bytes.get((item.job_id, index))
            if data is None:
                raise PoolError(ErrorCode.INTERNAL, "the image's shared memory was gone")
            return data
        if source.url:
            return images.fetch(source.url, self.images)
        if source.data:
            return source.data
        raise PoolError(ErrorCode.BAD_REQUEST, "an image needs data or a url")

    def opened_images(self, item: WorkItem) -> list[Any]:
        from modelpool.workers.capabilities import images

        count = len(kind_of(item.request).images(item.request))
        return images.opened([self.image_data(item, i) for i in range(count)], self.images)

    def receive(self) -> Work | Abort | Shutdown | Threads:
        try:
            return to_worker_decoder.decode(recv_frame(self.sock))
        except (EOFError, OSError):
            os._exit(exitcodes.SUPERVISOR_GONE)
        except (msgspec.DecodeError, FrameTooLarge):
            os._exit(exitcodes.PROTOCOL_ERROR)

    def _handle_control(self, msg: Work | Abort | Shutdown | Threads) -> None:
        match msg:
            case Abort(job_id=job_id):
                self.aborts.add(job_id)
            case Shutdown():
                self.stopping = True
            case Threads(count=count):
                self.threads_wanted = count
            case Work():
                os._exit(exitcodes.PROTOCOL_ERROR)  # work is only sent when we ask for it


def heartbeat_loop(sock: socket.socket, worker: Worker, interval: float,
                   idle_load_s: float) -> None:
    """Beats until the supervisor is gone. A load runs at idle priority so that it slows
    no serving model; one still running after idle_load_s competes normally instead, so
    that it finishes even on a machine that serving keeps busy (where an idle task gets
    almost no CPU)."""
    priority.restore_this_thread()  # a slow, idle-priority load must still beat on time
    seq, started, raised = 0, time.monotonic(), False
    while True:
        if not worker.loaded and not raised and time.monotonic() - started > idle_load_s:
            priority.restore_all_threads()
            raised = True
        beat = worker.progress if worker.loaded else load_progress()
        try:
            send_frame(sock, encoder.encode(Heartbeat(seq=seq, progress=beat,
                                                      tokens=worker.tokens,
                                                      threads=worker.threads)))
        except OSError:
            return  # the supervisor is gone; the work pipe will tell the main thread
        seq += 1
        time.sleep(interval)


def run_worker(settings_bytes: bytes, work_sock: socket.socket, beat_sock: socket.socket) -> None:
    """Entry point in the child process."""
    # Ctrl-C at a terminal signals the whole process group; the supervisor decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = msgspec.msgpack.decode(settings_bytes, type=WorkerSettings)
    worker = Worker(work_sock, settings.images)
    threading.Thread(target=heartbeat_loop, name="heartbeat", daemon=True,
                     args=(beat_sock, worker, settings.heartbeat_interval_s,
                           settings.idle_load_s)).start()
    model, batching = _load(settings, worker)  # at idle priority, from the forkserver
    worker.set_model_threads = partial(set_threads, model)
    worker.threads_wanted = settings.threads
    worker.use_threads()  # set at load already: this records it, for the heartbeats
    worker.loaded = True
    if settings.hold_segment is not None:
        hold(worker)  # stays idle: it only keeps the weights alive
    priority.restore_all_threads()
    if batching is not None:
        serve_streams(model, settings, worker, batching)
    serve(model, settings, worker)


def _load(settings: WorkerSettings, worker: Worker) -> tuple[object, Plan | None]:
    # Here, not at the top: the forkserver imports this module, and only embedding models
    # need the registry's ONNX cache (their loader imports it anyway).
    from modelpool.registry.loaders.onnx_cache import ExportNotMade

    started = time.perf_counter()
    try:
        if settings.threads and "torch" in sys.modules:  # not imported for ONNX models
            sys.modules["torch"].set_num_threads(settings.threads)
        model, weights_mb, shared = _load_weights(settings)
        if settings.threads:
            set_threads(model, settings.threads)
    except ExportNotMade as exc:
        worker.send(ExportFirst(entry=str(exc.entry), model_dir=str(exc.model_dir)))
        _exit(exitcodes.OK)  # no failure: its model starts again once the export is made
    except BaseException as exc:
        worker.send(LoadFailed(cause=f"{type(exc).__name__}: {exc}"))
        _exit(exitcodes.LOAD_FAILED)
    info = model.info() if hasattr(model, "info") else {}
    batching = None
    if settings.hold_segment is None:
        from modelpool.workers import streams
        from modelpool.workers.capabilities import PREPARERS

        batching = streams.plan(model, settings, settings.spec.capability in PREPARERS)
    if batching is not None:
        info = {**info, "max_active_sequences": batching.slots}
    worker.send(Ready(pid=os.getpid(), load_s=time.perf_counter() - started,
                      uss_mb=_uss_mb(), weights_mb=weights_mb, info=info,
                      vram_mb=_vram_mb(settings.spec.device), weights=shared))
    return model, batching


def _load_weights(settings: WorkerSettings) -> tuple[object, float | None, SharedWeights | None]:
    """(model, size of the weights it maps, what a holder shares)."""
    from modelpool.registry.loaders import load_model_with_dir, weights_size_mb

    spec = settings.spec
    if settings.weights is None:
        model, model_dir = load_model_with_dir(spec)
        if settings.hold_segment is None:
            return model, weights_size_mb(model_dir), None
        from modelpool.workers import shared_weights  # torch: not for ONNX models

        shared = shared_weights.export(model, settings.hold_segment)
        return model, shared.segment_bytes / 2**20, shared
    # Built on the CPU, where file-backed weights cost nothing, then moved onto the
    # holder's tensors: a GPU worker never allocates a copy of its own.
    from modelpool.registry.loaders.common import device_of
    from modelpool.workers import shared_weights

    model, _ = load_model_with_dir(msgspec.structs.replace(spec, device="cpu"))
    shared_weights.attach(model, settings.weights, device_of(spec))
    release_memory()
    return model, None, None


def hold(worker: Worker) -> NoReturn:
    """A holder answers nothing: it keeps the weights alive until told to stop. (The
    supervisor removes its segment once it has exited, however it exits.)"""
    while not isinstance(worker.receive(), Shutdown):
        pass  # nothing else is meant for a holder
    _exit(exitcodes.OK)


def serve(model: object, settings: WorkerSettings, worker: Worker) -> NoReturn:
    from modelpool.workers.capabilities import ADAPTERS

    adapter = ADAPTERS[settings.spec.capability]
    # Exactly one WantWork per free slot, which the supervisor counts on: this one, then
    # one with each Work's replies.
    worker.send(WantWork())
    trim_when_idle = False
    while not worker.stopping:
        if trim_when_idle and not select.select([worker.sock], [], [], IDLE_TRIM_S)[0]:
            release_memory()
            trim_when_idle = False
        msg = worker.receive()
        match msg:
            case Work(items=items, threads=threads):
                worker.threads_wanted = threads or worker.threads_wanted
                worker.use_threads()
                worker.held = []
                worker.take_images(items)
                adapter(model, items, worker, settings.max_batch)
                worker.image_bytes = {}
                worker.aborts.clear()  # job ids never repeat: old aborts mean nothing
                worker.tick()
                worker.finish_work()
                trim_when_idle = True
            case Abort():
                pass  # for a job already finished: its reply crossed the abort
            case Threads():
                pass  # for a stream that has ended: the next Work brings its own count
            case Shutdown():
                worker.stopping = True
    priority.idle_all_threads()  # tearing down must not slow the serving workers
    _exit(exitcodes.OK)


def serve_streams(model: object, settings: WorkerSettings, worker: Worker,
                  batching: Plan) -> NoReturn:
    """Continuous batching: several streams at once (workers/streams.py)."""
    from modelpool.workers import streams
    from modelpool.workers.capabilities import PREPARERS

    prepare = PREPARERS[settings.spec.capability]
    loop = streams.StreamLoop(batching.decoder, lambda item: prepare(model, item, worker),
                              worker)
    loop.run(batching.slots, release_memory)
    priority.idle_all_threads()
    _exit(exitcodes.OK)


def set_threads(model: object, threads: int) -> bool:
    """The model's own way (an ONNX Runtime session per count), else torch's pool, which
    is the process's: ~1 ms to change (OpenMP resizes its team), so only on a change.
    False: neither (a model that runs without torch and has no threads to set)."""
    own = getattr(model, "set_threads", None)
    if callable(own):
        own(threads)
        return True
    if "torch" not in sys.modules:
        return False
    if sys.modules["torch"].get_num_threads() != threads:
        sys.modules["torch"].set_num_threads(threads)
    return True


def release_memory() -> None:
    """Give freed heap back to the OS. A large batch leaves ~90 MB of activations in
    malloc's free lists; an idle worker should not keep that resident."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _vram_mb(device: str) -> float | None:
    """GPU memory this worker holds; only asked on a GPU (CUDA is never touched on CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.memory_reserved(torch.device(device)) / 2**20


def _uss_mb() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_full_info().uss / 2**20
    except Exception:
        return None


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
