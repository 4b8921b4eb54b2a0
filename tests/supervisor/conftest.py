"""Fakes for driving the Pool as the event loop would, without processes.

A fake launcher "starts" a worker by giving its handle a pid and a fake writer that
decodes every frame the pool sends; the test then plays the worker by calling
pool.handle / pool.handle_exit. A fake scheduler is the pool's one clock: every
timestamp and every timer (timeouts, deadlines, batch waits, kill timers) moves only
when the test advances it, so no test here sleeps.

`async def` tests in this directory run under asyncio.run (pytest-asyncio is not used).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import os
import struct
from collections.abc import Callable
from typing import Any

import pytest

from modelpool.protocol.fields import RequestDefaults
from modelpool.protocol.framing import HEADER
from modelpool.protocol.messages import (
    Chunk,
    Embed,
    Embeddings,
    End,
    Error,
    Generate,
    Sampling,
)
from modelpool.protocol.pipes import (
    Ready,
    SharedWeights,
    ToWorker,
    WantWork,
    Work,
    to_worker_decoder,
)
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.config import Config, PoolConfig
from modelpool.supervisor.gpus import Gpu
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.queueing import Job
from modelpool.supervisor.workers import WorkerHandle, WorkerState

ASYNC_TEST_TIMEOUT_S = 5.0
# A real process (the ONNX export imports torch and transformers first: 4-5 s here when
# the machine is busy) is not bounded like the fake clock's tests.
REAL_PROCESS_TIMEOUT_S = 120.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run `async def` tests in a fresh event loop."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    real = pyfuncitem.get_closest_marker("real_process") is not None
    timeout_s = REAL_PROCESS_TIMEOUT_S if real else ASYNC_TEST_TIMEOUT_S
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), timeout_s))
    return True


class FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeScheduler:
    """The pool's clock and timers, moved only by advance()."""

    WALL_OFFSET = 1.7e9  # wall() = now() + this, like a real epoch clock

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, FakeTimer, Callable[..., object], tuple]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self.WALL_OFFSET

    def call_later(self, delay_s: float, callback: Callable[..., object],
                   *args: Any) -> FakeTimer:
        timer = FakeTimer()
        heapq.heappush(self._timers, (self._now + max(0.0, delay_s), next(self._order), timer,
                                      callback, args))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, firing every timer that falls due, in order."""
        until = self._now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, timer, callback, args = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not timer.cancelled:
                callback(*args)
        self._now = until

    def pending(self) -> int:
        return sum(not t[2].cancelled for t in self._timers)


class FakeWriter:
    """Stands in for a worker's work-pipe StreamWriter; decodes what the pool sends."""

    def __init__(self) -> None:
        self.sent: list[ToWorker] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        (size,) = HEADER.unpack(data[: HEADER.size])
        assert size == len(data) - HEADER.size, "one write must be one whole frame"
        self.sent.append(to_worker_decoder.decode(data[HEADER.size:]))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


class FakeLauncher:
    """Records starts, shutdowns and kills. A worker told to shut down exits with code 0
    on the next loop iteration, as a worker honouring Shutdown would; a killed one dies
    of the signal likewise."""

    def __init__(self) -> None:
        self.events: Pool | None = None
        self.started: list[WorkerHandle] = []
        self.settings: list[Any] = []
        self.stopped: list[WorkerHandle] = []
        self.killed: list[WorkerHandle] = []
        self.raised: list[WorkerHandle] = []
        self.exit_on_stop = True
        self._pids = itertools.count(4001)

    async def start(self, handle: WorkerHandle, settings: Any) -> None:
        handle.pid = next(self._pids)
        handle.writer = FakeWriter()  # type: ignore[assignment]
        self.started.append(handle)
        self.settings.append(settings)

    def shutdown(self, handle: WorkerHandle) -> bool:
        self.stopped.append(handle)
        if self.exit_on_stop:
            asyncio.get_running_loop().call_soon(self.exit, handle, 0)
        return True

    def raise_priority(self, handle: WorkerHandle) -> None:
        self.raised.append(handle)

    def kill(self, handle: WorkerHandle) -> None:
        """SIGKILL: the process dies on the next loop iteration."""
        self.killed.append(handle)
        if handle.pid is not None:
            asyncio.get_running_loop().call_soon(self.exit, handle, -9)

    def exit(self, handle: WorkerHandle, exitcode: int | None) -> None:
        """The process is gone: what the real launcher reports when the sentinel fires."""
        if handle.state is WorkerState.DEAD:
            return
        assert self.events is not None
        self.events.handle_exit(handle, exitcode)


class FakeSink:
    """A client connection: records every reply."""

    def __init__(self, name: str = "client") -> None:
        self.name = name
        self.owner = name  # sinks of one name share a turn in fair queueing
        self.closed = False
        self.jobs: dict[int, Job] = {}
        self.messages: list[Any] = []

    def send(self, msg: Any) -> None:
        self.messages.append(msg)

    def errors(self) -> list[Error]:
        return [m for m in self.messages if isinstance(m, Error)]

    def finals(self, client_id: int) -> list[Any]:
        """The final replies (Embeddings, End, Error) this sink got for one request."""
        return [m for m in self.messages
                if isinstance(m, Embeddings | End | Error) and m.id == client_id]

    def only_error(self, client_id: int) -> Error:
        """The one final reply of a request, which must be an Error."""
        (reply,) = self.finals(client_id)
        assert isinstance(reply, Error), reply
        return reply


def make_config(models: list[ModelSpec] | None = None,
                defaults: RequestDefaults | None = None, **pool: Any) -> Config:
    if models is None:
        models = [
            ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                      weights_mb=10, per_worker_mb=10),
            ModelSpec(key="gen", capability="text_to_text", path="/nonexistent",
                      weights_mb=10, per_worker_mb=10),
        ]
    # Dispatch at once unless a test is about waiting for a batch to fill.
    pool.setdefault("max_batch_wait_ms", 0)
    return Config(pool=PoolConfig(**pool), models=models,
                  defaults=defaults or RequestDefaults())


def rows(*values: float) -> bytes:
    """float32 bytes, so each reply carries recognisable data."""
    return struct.pack(f"<{len(values)}f", *values)


class Harness:
    """A Pool wired to the fakes, plus the moves of a worker and a client."""

    def __init__(self, config: Config, gpus: list[Gpu] | None = None) -> None:
        self.clock = FakeScheduler()
        self.launcher = FakeLauncher()
        self.pool = Pool(config, config.registry(), self.launcher,  # type: ignore[arg-type]
                         self.clock, gpus=gpus, cpus=os.cpu_count() or 1)
        self.launcher.events = self.pool
        self._ids = itertools.count(1)

    # ---- client side -----------------------------------------------------------------

    def sink(self, name: str = "client") -> FakeSink:
        return FakeSink(name)

    def embed(self, sink: FakeSink, texts: list[str], model: str = "emb",
              **kw: Any) -> int:
        client_id = kw.pop("id", None) or next(self._ids)
        self.pool.submit(sink, Embed(id=client_id, model=model, texts=texts, **kw))
        return client_id

    def generate(self, sink: FakeSink, prompt: str = "hi", model: str = "gen",
                 **kw: Any) -> int:
        """Sampling parameters (temperature, seed, ...) may be given as keywords."""
        client_id = kw.pop("id", None) or next(self._ids)
        sampling = {k: kw.pop(k) for k in list(kw) if k in Sampling.__struct_fields__}
        self.pool.submit(sink, Generate(id=client_id, model=model, prompt=prompt,
                                        sampling=Sampling(**sampling), **kw))
        return client_id

    def used_mb(self, device: str = "cpu") -> float:
        """What the pool charges against the memory budget of device."""
        return self.pool.capacity.used_mb(self.pool.models.values(), device)

    # ---- worker side -----------------------------------------------------------------

    async def settle(self) -> None:
        """Let launch tasks and call_soon callbacks run."""
        for _ in range(5):
            await asyncio.sleep(0)

    def workers(self, model: str) -> list[WorkerHandle]:
        """Serving workers started for the model, in start order (holders left out)."""
        return [w for w, s in zip(self.launcher.started, self.launcher.settings, strict=True)
                if w.model_key == model and s.hold_segment is None]

    def holders(self, model: str) -> list[WorkerHandle]:
        return [w for w, s in zip(self.launcher.started, self.launcher.settings, strict=True)
                if w.model_key == model and s.hold_segment is not None]

    def hold(self, holder: WorkerHandle, weights: SharedWeights,
             weights_mb: float | None = None, vram_mb: float | None = None) -> None:
        """The holder has loaded and shares its weights."""
        assert holder.pid is not None
        self.pool.handle(holder, Ready(pid=holder.pid, load_s=0.1, weights=weights,
                                                  weights_mb=weights_mb, vram_mb=vram_mb))

    def ready(self, worker: WorkerHandle, want_work: bool = True,
              info: dict[str, Any] | None = None) -> None:
        assert worker.pid is not None
        self.pool.handle(worker, Ready(pid=worker.pid, load_s=0.1,
                                                  info=info if info is not None else {"dim": 2}))
        if want_work:
            self.want_work(worker)

    def want_work(self, worker: WorkerHandle) -> None:
        self.pool.handle(worker, WantWork())

    def sent(self, worker: WorkerHandle) -> list[ToWorker]:
        writer = worker.writer
        assert isinstance(writer, FakeWriter)
        return writer.sent

    @staticmethod
    def items(work: Work) -> list[tuple[int, Any]]:
        """(job id, request) of each item of a Work message."""
        return [(item.job_id, item.request) for item in work.items]

    def works(self, worker: WorkerHandle) -> list[Work]:
        return [m for m in self.sent(worker) if isinstance(m, Work)]

    def job_ids(self, worker: WorkerHandle) -> list[int]:
        """Job ids of every item the worker was handed, in order."""
        return [item.job_id for work in self.works(worker) for item in work.items]

    def reply_embeddings(self, worker: WorkerHandle, job_id: int, *values: float) -> bytes:
        """One row of float32 values for job_id; returns the bytes sent."""
        data = rows(*values)
        self.pool.handle(worker, Embeddings(id=job_id, data=data,
                                                       shape=[1, len(values)]))
        return data

    def chunk(self, worker: WorkerHandle, job_id: int, seq: int, text: str) -> None:
        self.pool.handle(worker, Chunk(id=job_id, seq=seq, text=text))

    def end(self, worker: WorkerHandle, job_id: int, reason: str = "stop") -> None:
        self.pool.handle(worker, End(id=job_id, finish_reason=reason,
                                                completion_tokens=3))

    def die(self, worker: WorkerHandle, exitcode: int | None) -> None:
        self.launcher.exit(worker, exitcode)


@pytest.fixture
def make_harness() -> Callable[..., Harness]:
    """make_harness(**pool_config) -> Harness; make_harness(models=[...]) for other specs,
    gpus=[...] for a machine with (fake) GPUs, defaults=RequestDefaults(...)."""
    def make(models: list[ModelSpec] | None = None, gpus: list[Gpu] | None = None,
             defaults: RequestDefaults | None = None, **pool: Any) -> Harness:
        return Harness(make_config(models, defaults, **pool), gpus)

    return make
