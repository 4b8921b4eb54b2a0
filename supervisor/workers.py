"""Worker processes as the supervisor sees them: a WorkerHandle per process, whose
state moves only along the transitions allowed below, and the Launcher, which starts a
process from the forkserver, reads its pipes on the event loop, notices its death
through its sentinel, and signals it.

Nothing here decides anything: the pool changes handles and calls the launcher, and the
launcher reports what the processes said and did to the pool's WorkerEvents.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import multiprocessing
import multiprocessing.context
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec

from modelpool.protocol.framing import MAX_FRAME_BYTES, FrameReader, frame
from modelpool.protocol.messages import encoder
from modelpool.protocol.pipes import (
    FromWorker,
    Heartbeat,
    Shutdown,
    ToWorker,
    WorkerSettings,
    from_worker_decoder,
    heartbeat_decoder,
)
from modelpool.registry.loaders import TORCH_PRELOAD, preload_modules
from modelpool.supervisor import cgroups
from modelpool.supervisor.queueing import Job
from modelpool.supervisor.throughput import TokenRate
from modelpool.workers.fresh import run_fresh_worker

log = logging.getLogger("modelpool.workers")
REAP_AGAIN_S = 0.005


class WorkerState(enum.StrEnum):  # str's own hash: transitions are checked per request
    STARTING = "starting"  # process being created
    LOADING = "loading"  # process alive, model loading
    IDLE = "idle"  # ready and asking for work
    BUSY = "busy"  # holds at least one job
    HOLDING = "holding"  # a weights holder, loaded: it keeps the weights and serves nothing
    STOPPING = "stopping"  # told to shut down
    DEAD = "dead"


_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.LOADING, WorkerState.STOPPING,
                                     WorkerState.DEAD}),
    WorkerState.LOADING: frozenset({WorkerState.IDLE, WorkerState.HOLDING,
                                    WorkerState.STOPPING, WorkerState.DEAD}),
    WorkerState.IDLE: frozenset({WorkerState.BUSY, WorkerState.STOPPING, WorkerState.DEAD}),
    WorkerState.BUSY: frozenset({WorkerState.IDLE, WorkerState.STOPPING, WorkerState.DEAD}),
    WorkerState.HOLDING: frozenset({WorkerState.STOPPING, WorkerState.DEAD}),
    WorkerState.STOPPING: frozenset({WorkerState.DEAD}),
    WorkerState.DEAD: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(eq=False)
class WorkerHandle:
    worker_id: int
    model_key: str
    started_at: float
    state: WorkerState = WorkerState.STARTING
    process: multiprocessing.process.BaseProcess | None = None
    pid: int | None = None
    slots: int = 0  # units of work it asked for and has not been given (WantWork)
    jobs: dict[int, Job] = field(default_factory=dict)
    last_used: float = 0.0
    ready_at: float | None = None
    spawned_at: float | None = None  # when its process existed (the forkserver may be slow)
    last_heartbeat: float | None = None
    progress: int = 0
    progress_changed_at: float = 0.0
    tokens: TokenRate = field(default_factory=TokenRate)  # generated, from heartbeats
    last_dispatch_at: float = 0.0  # a new job resets the stall clock
    threads: int = 0  # intra-op threads its current work may use (supervisor/threads.py)
    threads_in_use: int = 0  # what its heartbeats say its forward passes use; 0: unknown
    hung: str | None = None  # why it was judged hung and killed
    late: bool = False  # silent past late_after_s (supervisor/health.py): no new work
    raised_at: float | None = None  # silent since its start: raised from idle priority
    stop_requested: bool = False  # we stopped it: exiting before Ready is no load failure
    outdated: str | None = None  # why a new worker would serve better (supervisor/exports.py)
    uss_mb: float | None = None
    load_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    load_error: str | None = None  # its loader failed (or its load timed out or stalled)
    start_error: str | None = None  # its process could not be started
    writer: asyncio.Transport | None = None  # the work pipe's
    beat_writer: asyncio.Transport | None = None  # unused, owns the heartbeat socket
    kill_timer: Any = None  # the scheduler's timer that SIGKILLs it if it will not stop

    def move_to(self, state: WorkerState) -> None:
        """The one way a worker's state changes; an impossible move is a bug."""
        if state not in _MOVES[self.state]:
            raise IllegalTransition(f"worker {self.worker_id}: {self.state.value} -> "
                                    f"{state.value}")
        self.state = state

    def note_heartbeat(self, beat: Heartbeat, now: float) -> None:
        self.last_heartbeat = now
        self.threads_in_use = beat.threads
        self.tokens.note(now, beat.tokens)
        if beat.progress != self.progress:
            self.progress, self.progress_changed_at = beat.progress, now

    @property
    def alive(self) -> bool:
        return self.state is not WorkerState.DEAD

    @property
    def ready(self) -> bool:
        return self.state in (WorkerState.IDLE, WorkerState.BUSY)

    def send(self, msg: ToWorker) -> bool:
        if self.writer is None or self.writer.is_closing():
            return False
        self.writer.write(frame(encoder.encode(msg)))
        return True


def forkserver_context(preload: list[str]) -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["modelpool.workers.preload", *preload, "modelpool.workers.preloaded"])
    return ctx


def starts_fresh(forkserver_preload: list[str], model_preload: list[str]) -> bool:
    """Whether a worker asked for while the forkserver still imports starts in a fresh
    interpreter rather than waiting to be forked: when the forkserver imports torch
    (seconds) for other models and this one needs none of it. Once the forkserver is
    ready, every worker is forked from it, sharing its pages."""
    return TORCH_PRELOAD in forkserver_preload and TORCH_PRELOAD not in model_preload


class Pipe(asyncio.Protocol):
    """A worker's pipe, read as its bytes arrive: each whole frame is decoded and handed
    to deliver at once, in the loop's callback (through a StreamReader task, each frame
    cost a future, a task step in a later turn of the loop and two readexactly calls).
    A frame that is too large or undecodable goes to refuse, and the pipe is read no
    more: the worker's sentinel reports what follows."""

    def __init__(self, decoder: msgspec.msgpack.Decoder[Any], deliver: Callable[[Any], None],
                 refuse: Callable[[str], None]) -> None:
        self.decoder = decoder
        self.deliver = deliver
        self.refuse = refuse
        self.frames = FrameReader()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        while (payload := self.frames.next(MAX_FRAME_BYTES)) is not None:
            if isinstance(payload, int):
                self._stop(f"frame of {payload} bytes exceeds the limit of "
                           f"{MAX_FRAME_BYTES} bytes")
                return
            try:
                msg = self.decoder.decode(payload)
            except msgspec.DecodeError as exc:
                self._stop(str(exc))
                return
            self.deliver(msg)
        self.frames.compact()

    def _stop(self, why: str) -> None:
        assert self.transport is not None
        self.transport.pause_reading()
        self.refuse(why)


class WorkerEvents(Protocol):
    """What the launcher reports, as it happens, to whoever owns the workers."""

    def handle(self, worker: WorkerHandle, msg: FromWorker) -> None: ...

    def handle_heartbeat(self, worker: WorkerHandle, beat: Heartbeat) -> None: ...

    def handle_exit(self, worker: WorkerHandle, exitcode: int | None) -> None: ...


class Launcher:
    """Starts worker processes and wires their pipes and sentinel into the event loop."""

    def __init__(self, preload: list[str]) -> None:
        """preload: the configured models' modules, for the forkserver to import."""
        self.preload = preload
        self.ctx = forkserver_context(preload)
        self.forkserver_ready = False  # its imports done: a fork now waits for nothing
        self.events: WorkerEvents | None = None  # the pool, once it exists

    async def warm_up(self) -> None:
        """Start the forkserver now so its imports overlap with the daemon's start-up,
        and know when they are done: a first process forked from it (which exits at
        once) starts only then."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        probe = self.ctx.Process(target=int, name="modelpool-forkserver-probe", daemon=True)
        try:
            await loop.run_in_executor(None, probe.start)
        except (OSError, EOFError) as exc:  # stopped while it imported: nothing to know
            log.debug("the forkserver was not ready: %s", exc)
            return
        self.forkserver_ready = True
        log.info("forkserver ready in %.2fs", time.monotonic() - started)
        await loop.run_in_executor(None, probe.join)

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop the forkserver so no process outlives the daemon. Told only by its pipe's
        closing, it would notice after finishing its imports, which may take seconds, and
        then free its preloaded heap object by object (torch's: ~0.4 s of every stop
        here); it holds nothing to save, so SIGTERM, which it leaves at its default, ends
        it at once."""
        from multiprocessing import forkserver

        server = forkserver._forkserver  # CPython has no public API for this
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, server._stop)
        try:
            await asyncio.wait_for(asyncio.shield(stopping), max(0.0, grace_s))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await stopping

    async def start(self, handle: WorkerHandle, settings: WorkerSettings) -> None:
        from modelpool.workers.main import run_worker  # by reference only: no torch here

        loop = asyncio.get_running_loop()
        work_parent, work_child = socket.socketpair()
        beat_parent, beat_child = socket.socketpair()
        fresh = not self.forkserver_ready and starts_fresh(
            self.preload, preload_modules([settings.spec]))
        ctx = multiprocessing.get_context("spawn") if fresh else self.ctx
        process = ctx.Process(
            target=run_fresh_worker if fresh else run_worker,
            args=(msgspec.msgpack.encode(settings), work_child, beat_child),
            name=f"modelpool-worker-{handle.worker_id}",
            daemon=True,
        )
        try:
            # start() talks to the forkserver, which may still be importing torch.
            await loop.run_in_executor(None, process.start)
        finally:
            work_child.close()
            beat_child.close()
        handle.process, handle.pid = process, process.pid
        events = self.events
        assert events is not None

        def refuse_work(why: str) -> None:
            log.error("worker %s sent an unreadable message (%s); killing it",
                      handle.worker_id, why)
            self.kill(handle)

        work = Pipe(from_worker_decoder, lambda msg: events.handle(handle, msg), refuse_work)
        # A silent worker is judged hung by its missing heartbeats: nothing more to do.
        beats = Pipe(heartbeat_decoder, lambda beat: events.handle_heartbeat(handle, beat),
                     lambda why: None)
        # Keep the transports referenced: a collected transport closes its socket.
        handle.writer = cast(asyncio.Transport, (await loop.create_unix_connection(
            lambda: work, sock=work_parent))[0])
        handle.beat_writer = cast(asyncio.Transport, (await loop.create_unix_connection(
            lambda: beats, sock=beat_parent))[0])
        loop.add_reader(process.sentinel, self._exited, handle)

    def _exited(self, handle: WorkerHandle) -> None:
        process = handle.process
        assert process is not None
        asyncio.get_running_loop().remove_reader(process.sentinel)
        self._reap(handle)

    def _reap(self, handle: WorkerHandle) -> None:
        process = handle.process
        assert process is not None and self.events is not None
        exitcode = process.exitcode  # without waiting
        if exitcode is None:
            # A fresh interpreter's sentinel (a pipe) closes as it exits, a moment before
            # it can be reaped; the forkserver reports its children once reaped.
            asyncio.get_running_loop().call_later(REAP_AGAIN_S, self._reap, handle)
            return
        for writer in (handle.writer, handle.beat_writer):
            if writer is not None:
                writer.close()
        process.close()
        self.events.handle_exit(handle, exitcode)

    def shutdown(self, handle: WorkerHandle) -> bool:
        """Ask the worker to exit after its current work; False if it cannot be told."""
        return handle.send(Shutdown())

    def raise_priority(self, handle: WorkerHandle) -> None:
        """Out of idle priority: a worker starved of CPU at its start (health.py)."""
        if handle.pid is not None:
            cgroups.to_normal_priority(handle.pid)

    def kill(self, handle: WorkerHandle) -> None:
        if handle.pid is not None and handle.state is not WorkerState.DEAD:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGKILL)
