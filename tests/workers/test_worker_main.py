"""The real worker entry point in a real child process, started from a forkserver with two
socket pairs exactly as supervisor/workers.py's Launcher.start does; the test plays the
supervisor's side of the pipes."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import msgspec
import numpy as np
import pytest

from modelpool.protocol.framing import recv_frame, send_frame
from modelpool.protocol.messages import Chunk, Embed, Embeddings, encoder
from modelpool.protocol.pipes import (
    Abort,
    FromWorker,
    Heartbeat,
    LoadFailed,
    Ready,
    Replies,
    Shutdown,
    Threads,
    WantWork,
    Work,
    WorkerSettings,
    WorkItem,
    from_worker_decoder,
    heartbeat_decoder,
)
from modelpool.registry.loaders import preload_modules
from modelpool.registry.spec import ModelSpec, Registry, load_catalog
from modelpool.supervisor.workers import forkserver_context
from modelpool.workers import exitcodes
from modelpool.workers.main import Worker, run_worker

TIMEOUT_S = 60.0


@dataclass
class Child:
    process: BaseProcess
    work: socket.socket
    beat: socket.socket

    def recv(self) -> FromWorker:
        return from_worker_decoder.decode(recv_frame(self.work))

    def send(self, msg: msgspec.Struct) -> None:
        send_frame(self.work, encoder.encode(msg))

    def heartbeat(self) -> Heartbeat:
        return heartbeat_decoder.decode(recv_frame(self.beat))

    def exitcode(self) -> int | None:
        self.process.join(TIMEOUT_S)
        return self.process.exitcode

    def wait_ready(self) -> Ready:
        ready = self.recv()
        assert isinstance(ready, Ready), ready
        assert isinstance(self.recv(), WantWork)
        return ready


StartWorker = Callable[[ModelSpec], Child]


@pytest.fixture(scope="module")
def minilm() -> ModelSpec:
    spec = Registry(load_catalog()).resolve("minilm")
    assert spec is not None
    return spec


@pytest.fixture
def start_worker(minilm: ModelSpec) -> Iterator[StartWorker]:
    # As the daemon starts its forkserver for MiniLM (one forkserver per test process:
    # whichever test starts it first chooses what it imports).
    ctx = forkserver_context(preload_modules([minilm]))
    children: list[Child] = []

    def start(spec: ModelSpec) -> Child:
        settings = WorkerSettings(worker_id=1, spec=spec, threads=1, max_batch=8,
                                  heartbeat_interval_s=0.05)
        work_parent, work_child = socket.socketpair()
        beat_parent, beat_child = socket.socketpair()
        process = ctx.Process(target=run_worker, daemon=True, name="test-worker",
                              args=(msgspec.msgpack.encode(settings), work_child, beat_child))
        try:
            process.start()
        finally:
            work_child.close()
            beat_child.close()
        work_parent.settimeout(TIMEOUT_S)
        beat_parent.settimeout(TIMEOUT_S)
        child = Child(process, work_parent, beat_parent)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.process.is_alive():
            child.process.kill()
        child.process.join(10)
        child.work.close()
        child.beat.close()


def _embed_work(job_id: int, texts: list[str]) -> Work:
    return Work(items=[WorkItem(job_id=job_id, request=Embed(id=1, texts=texts))])


def _check_embedding(msg: FromWorker, job_id: int) -> None:
    """msg: the Replies of a Work of one job."""
    assert isinstance(msg, Replies), msg
    (msg,) = msg.items
    assert isinstance(msg, Embeddings), msg
    assert msg.id == job_id and msg.shape == [1, 384] and msg.dtype == "float32"
    vector = np.frombuffer(msg.data, dtype=np.float32)
    assert vector.shape == (384,)
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4


def test_ready_work_heartbeat_shutdown(start_worker: StartWorker, minilm: ModelSpec) -> None:
    child = start_worker(minilm)
    ready = child.wait_ready()
    assert ready.pid == child.process.pid
    assert ready.info["dim"] == 384
    assert ready.load_s > 0

    child.send(_embed_work(5, ["hi"]))
    assert isinstance(child.recv(), WantWork)
    _check_embedding(child.recv(), 5)

    # Heartbeats count up from 0 without gaps, and progress has advanced past the batch.
    expected_seq, deadline = 0, time.monotonic() + TIMEOUT_S
    while True:
        beat = child.heartbeat()
        assert beat.seq == expected_seq
        expected_seq += 1
        if beat.progress >= 2 and beat.seq >= 3:
            break
        assert time.monotonic() < deadline, "progress never advanced"

    child.send(Shutdown())
    assert child.exitcode() == exitcodes.OK


def test_load_failure_is_reported_with_its_cause(start_worker: StartWorker) -> None:
    spec = ModelSpec(key="broken", capability="text_embedding",
                     loader="nonexistent.module:fn")
    child = start_worker(spec)
    msg = child.recv()
    assert isinstance(msg, LoadFailed), msg
    assert "nonexistent" in msg.cause
    assert child.exitcode() == exitcodes.LOAD_FAILED


def test_closed_work_pipe_means_supervisor_gone(
    start_worker: StartWorker, minilm: ModelSpec
) -> None:
    child = start_worker(minilm)
    child.wait_ready()
    child.work.close()
    assert child.exitcode() == exitcodes.SUPERVISOR_GONE


def test_stale_abort_while_idle_does_not_ask_for_work_twice(
    start_worker: StartWorker, minilm: ModelSpec
) -> None:
    child = start_worker(minilm)
    child.wait_ready()
    child.send(Abort(job_id=99))  # job 99 already ended; the supervisor had not seen it yet
    child.send(_embed_work(6, ["hello"]))
    assert isinstance(child.recv(), WantWork)
    _check_embedding(child.recv(), 6)  # buggy: a second WantWork comes instead
    child.send(Shutdown())
    assert child.exitcode() == exitcodes.OK


def test_a_works_final_replies_leave_as_one_after_its_want_work_and_chunks_at_once() -> None:
    """So the supervisor sees this worker free before it passes the replies on: a lone
    client's next request then comes back to the same, warm worker, and under load the
    next batch is sent before the replies are passed on."""
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    worker = Worker(ours)
    worker.held = []
    worker.send(Embeddings(id=1, data=b"\0" * 4, shape=[1, 1]))
    with pytest.raises(BlockingIOError):
        theirs.recv(1)  # held
    worker.send(Chunk(id=2, seq=0, text="a"))  # a stream's chunk: at once, after it
    worker.send(Embeddings(id=3, data=b"\0" * 4, shape=[1, 1]))
    worker.finish_work()
    theirs.setblocking(True)
    theirs.settimeout(TIMEOUT_S)
    got = [from_worker_decoder.decode(recv_frame(theirs)) for _ in range(4)]
    assert [type(m) for m in got] == [Replies, Chunk, WantWork, Replies]
    ids = [[r.id for r in m.items] if isinstance(m, Replies) else getattr(m, "id", None)
           for m in got]
    assert ids == [[1], 2, None, [3]]
    assert worker.held is None
    ours.close()
    theirs.close()


def test_threads_granted_mid_stream_apply_once_at_the_next_check() -> None:
    """A one-at-a-time stream checks for aborts between tokens: the grants that came
    meanwhile are applied there, the last one only, and only if it changes the count."""
    ours, theirs = socket.socketpair()
    worker = Worker(ours)
    applied: list[int] = []

    def set_model_threads(count: int) -> bool:
        applied.append(count)
        return True

    worker.set_model_threads = set_model_threads
    worker.threads = 1
    for count in (2, 1, 2):
        send_frame(theirs, encoder.encode(Threads(count=count)))
    assert not worker.aborted(7)
    assert applied == [2] and worker.threads == 2
    send_frame(theirs, encoder.encode(Threads(count=2)))
    assert not worker.aborted(7)
    assert applied == [2]  # the count it has: nothing to change
    ours.close()
    theirs.close()
