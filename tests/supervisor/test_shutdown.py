"""Graceful stop: drain, cut what is left with SHUTTING_DOWN, stop every worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embeddings, End, Error
from modelpool.supervisor import shutdown

if TYPE_CHECKING:
    from conftest import FakeSink, Harness

MakeHarness = Callable[..., "Harness"]


def one_final(sink: FakeSink, client_id: int) -> object:
    finals = sink.finals(client_id)
    assert len(finals) == 1, finals
    return finals[0]


def is_error(reply: object, code: ErrorCode) -> bool:
    return isinstance(reply, Error) and reply.code is code


async def test_drain_lets_running_job_finish_and_cuts_the_rest(
        make_harness: MakeHarness) -> None:
    h = make_harness(shutdown_timeout_s=0.2)
    sink = h.sink()
    running = h.embed(sink, ["a"])
    await h.settle()
    worker, loading = h.workers("emb")
    h.ready(worker)
    ((job_id, _),) = [(i.job_id, i.request) for i in h.works(worker)[0].items]
    queued = h.embed(sink, ["b"])

    drain = asyncio.create_task(shutdown.drain_and_stop(h.pool))
    await h.settle()
    late = h.embed(sink, ["c"])
    assert is_error(one_final(sink, late), ErrorCode.SHUTTING_DOWN)
    assert h.launcher.stopped == []  # still draining
    h.reply_embeddings(worker, job_id, 1.0)  # the worker answers during the drain
    await h.settle()
    assert not drain.done()  # "b" still waits for a worker
    h.clock.advance(0.2)  # the deadline

    drained, cut, kill_at = await drain

    assert isinstance(one_final(sink, running), Embeddings)
    reply = one_final(sink, queued)
    assert is_error(reply, ErrorCode.SHUTTING_DOWN) and "'emb'" in str(reply)
    assert (drained, cut, kill_at) == (1, 1, 1000.2 + shutdown.KILL_GRACE_S)
    assert set(h.launcher.stopped) == {worker, loading}
    assert all(not m.workers for m in h.pool.models.values())
    assert sink.jobs == {}
    assert len(h.launcher.started) == 2  # nothing restarted during shutdown


async def test_drain_returns_early_when_everything_finished(make_harness: MakeHarness) -> None:
    h = make_harness(shutdown_timeout_s=5.0)
    sink = h.sink()
    client_id = h.generate(sink)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    (item,) = h.works(worker)[0].items

    started = h.clock.now()
    drain = asyncio.create_task(shutdown.drain_and_stop(h.pool))
    await h.settle()
    h.chunk(worker, item.job_id, 0, "x")
    h.end(worker, item.job_id)
    assert (await drain)[:2] == (1, 0)

    assert h.clock.now() == started  # no waiting for the deadline
    assert sink.messages[0].id == client_id
    assert isinstance(one_final(sink, client_id), End)
    assert set(h.launcher.stopped) == set(h.workers("gen"))


async def test_stream_cut_by_the_deadline_gets_one_shutting_down(
        make_harness: MakeHarness) -> None:
    h = make_harness(shutdown_timeout_s=0.1)
    sink = h.sink()
    client_id = h.generate(sink)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    (item,) = h.works(worker)[0].items
    h.chunk(worker, item.job_id, 0, "x")

    drain = asyncio.create_task(shutdown.drain_and_stop(h.pool))
    await h.settle()
    h.clock.advance(0.1)
    assert (await drain)[:2] == (0, 1)

    assert is_error(one_final(sink, client_id), ErrorCode.SHUTTING_DOWN)
    h.end(worker, item.job_id)  # too late: the exit already cleared it
    assert len(sink.finals(client_id)) == 1


async def test_workers_that_ignore_stop_are_killed(make_harness: MakeHarness) -> None:
    h = make_harness()
    h.embed(h.sink(), ["a"])
    await h.settle()
    h.launcher.exit_on_stop = False

    await shutdown.stop_all_workers(h.pool, h.clock.now())

    workers = h.workers("emb")
    assert set(h.launcher.stopped) == set(workers)
    assert set(h.launcher.killed) == set(workers)


def test_what_is_left_to_exit_leaves_idle_priority() -> None:
    """A dying forkserver or worker at SCHED_IDLE gets no CPU on a busy machine and
    holds the daemon's exit up; at the end of the drain every child thread at SCHED_IDLE
    is put back to SCHED_OTHER (here without the idle cgroup: no environment for it)."""
    child = subprocess.Popen([sys.executable, "-c", "import os, time; os.sched_setscheduler("
                              "0, os.SCHED_IDLE, os.sched_param(0)); print(1, flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"1"
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
        shutdown.leave_idle_priority()
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
    finally:
        child.kill()
        child.wait()
