"""Worker processes as the supervisor sees them: start one from the forkserver, read its
pipes on the event loop, notice its death through its sentinel, stop it.

Nothing here decides anything; the pool calls these and is called back.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from modelpool.protocol.framing import frame, read_frame
from modelpool.protocol.messages import encoder
from modelpool.protocol.pipes import (
    FromWorker,
    Heartbeat,
    ToWorker,
    from_worker_decoder,
    heartbeat_decoder,
)
from modelpool.supervisor.queueing import Job

log = logging.getLogger("modelpool.workers")


class WorkerState(enum.Enum):
    STARTING = "starting"  # process being created
    LOADING = "loading"  # process alive, model loading
    IDLE = "idle"  # ready and asking for work
    BUSY = "busy"  # holds at least one job
    HOLDING = "holding"  # a weights holder, loaded: it keeps the weights and serves nothing
    STOPPING = "stopping"  # told to shut down
    DEAD = "dead"


@dataclass(eq=False)
class WorkerHandle:
    worker_id: int
    model_key: str
    started_at: float
    state: WorkerState = WorkerState.STARTING
    process: multiprocessing.process.BaseProcess | None = None
    pid: int | None = None
    wants_work: bool = False
    jobs: dict[int, Job] = field(default_factory=dict)
    last_used: float = 0.0
    ready_at: float | None = None
    spawned_at: float | None = None  # when its process existed (the forkserver may be slow)
    last_heartbeat: float | None = None
    progress: int = 0
    progress_changed_at: float = 0.0
    last_dispatch_at: float = 0.0  # a new job resets the stall clock
    hung: str | None = None  # why it was judged hung and killed
    stop_requested: bool = False  # we stopped it: exiting before Ready is no load failure
    uss_mb: float | None = None
    load_s: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    load_error: str | None = None
    writer: asyncio.StreamWriter | None = None
    beat_writer: asyncio.StreamWriter | None = None  # unused, owns the heartbeat socket
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    kill_timer: asyncio.TimerHandle | None = None

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


class Launcher:
    """Starts worker processes and wires their pipes and sentinel into the event loop."""

    def __init__(
        self,
        ctx: multiprocessing.context.ForkServerContext,
        on_message: Callable[[WorkerHandle, FromWorker], None],
        on_exit: Callable[[WorkerHandle, int | None], None],
        on_heartbeat: Callable[[WorkerHandle, Heartbeat], None],
    ) -> None:
        self.ctx = ctx
        self.on_message = on_message
        self.on_exit = on_exit
        self.on_heartbeat = on_heartbeat

    async def warm_up(self) -> None:
        """Start the forkserver now so its imports overlap with the daemon's start-up."""
        from multiprocessing import forkserver

        await asyncio.get_running_loop().run_in_executor(None, forkserver.ensure_running)

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop the forkserver so no process outlives the daemon. It notices on its own
        only after finishing its imports, which may take seconds."""
        from multiprocessing import forkserver

        server = forkserver._forkserver  # CPython has no public API for this
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, server._stop)
        try:
            await asyncio.wait_for(asyncio.shield(stopping), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await stopping

    async def start(self, handle: WorkerHandle, settings: msgspec.Struct) -> None:
        from modelpool.workers.main import run_worker  # imported by reference only: no torch here

        loop = asyncio.get_running_loop()
        work_parent, work_child = socket.socketpair()
        beat_parent, beat_child = socket.socketpair()
        process = self.ctx.Process(
            target=run_worker,
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
        reader, handle.writer = await asyncio.open_unix_connection(sock=work_parent)
        # Keep the writer referenced: a collected StreamWriter closes its socket.
        beat_reader, handle.beat_writer = await asyncio.open_unix_connection(sock=beat_parent)
        handle.tasks = [
            loop.create_task(self._read_work(handle, reader)),
            loop.create_task(self._read_heartbeats(handle, beat_reader)),
        ]
        loop.add_reader(process.sentinel, self._exited, handle)

    async def _read_work(self, handle: WorkerHandle, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                payload = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the sentinel reports the death
            try:
                msg = from_worker_decoder.decode(payload)
            except msgspec.DecodeError:
                log.error("worker %s sent an undecodable message; killing it", handle.worker_id)
                self.kill(handle)
                return
            self.on_message(handle, msg)

    async def _read_heartbeats(self, handle: WorkerHandle, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                beat: Heartbeat = heartbeat_decoder.decode(await read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
                return
            self.on_heartbeat(handle, beat)

    def _exited(self, handle: WorkerHandle) -> None:
        process = handle.process
        assert process is not None
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join(0)
        exitcode = process.exitcode
        self._release(handle)
        process.close()
        self.on_exit(handle, exitcode)

    def _release(self, handle: WorkerHandle) -> None:
        handle.state = WorkerState.DEAD
        if handle.kill_timer:
            handle.kill_timer.cancel()
        for task in handle.tasks:
            task.cancel()
        for writer in (handle.writer, handle.beat_writer):
            if writer is not None:
                writer.close()

    def stop(self, handle: WorkerHandle, grace_s: float) -> None:
        """Ask the worker to exit after its current job; SIGKILL it if it has not in grace_s."""
        if handle.state in (WorkerState.STOPPING, WorkerState.DEAD):
            return
        handle.state, handle.stop_requested = WorkerState.STOPPING, True
        from modelpool.protocol.pipes import Shutdown

        if not handle.send(Shutdown()):
            self.kill(handle)
            return
        loop = asyncio.get_running_loop()
        handle.kill_timer = loop.call_later(grace_s, self.kill, handle)

    def terminate(self, handle: WorkerHandle, grace_s: float) -> None:
        """SIGTERM now (a stopped process gets it when continued), SIGKILL after grace_s."""
        if handle.pid is None or handle.state is WorkerState.DEAD:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(handle.pid, signal.SIGTERM)
        if handle.kill_timer is None:
            handle.kill_timer = asyncio.get_running_loop().call_later(grace_s, self.kill, handle)

    def kill(self, handle: WorkerHandle) -> None:
        if handle.pid is not None and handle.state is not WorkerState.DEAD:
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, signal.SIGKILL)
