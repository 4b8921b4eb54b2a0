"""Memory budget, eviction and warm targets, driven through the real Pool with fakes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import control
from modelpool.supervisor.status import build_status
from modelpool.supervisor.workers import WorkerState

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Harness

    MakeHarness = Callable[..., Harness]

A = ModelSpec(key="a", capability="text_embedding", path="/x", weights_mb=100, per_worker_mb=50)
B = ModelSpec(key="b", capability="text_embedding", path="/x", weights_mb=100, per_worker_mb=50)
HUGE = ModelSpec(key="huge", capability="text_embedding", path="/x", weights_mb=5000,
                 per_worker_mb=50)


def harness(make_harness: MakeHarness, budget_mb: float, **pool: object) -> Harness:
    pool = {"cold_start_workers": 1, **pool}
    h = make_harness(models=[A, B, HUGE], **pool)
    h.pool.capacity.budget_mb = budget_mb  # independent of this machine's RAM
    return h


async def test_a_model_that_can_never_fit_fails_at_once(make_harness: MakeHarness) -> None:
    h = harness(make_harness, budget_mb=1000)
    sink = h.sink()
    h.embed(sink, ["x"], model="huge")
    (error,) = sink.errors()
    assert error.code is ErrorCode.INSUFFICIENT_MEMORY and "huge" in error.message
    assert h.workers("huge") == []


async def test_cold_start_stops_at_the_budget(make_harness: MakeHarness) -> None:
    h = harness(make_harness, budget_mb=190, cold_start_workers=2)
    h.embed(h.sink(), ["x"], model="a")
    await h.settle()
    assert len(h.workers("a")) == 1  # 150 for the first; a second would make 200 > 190
    assert h.used_mb() == 150


async def test_idle_model_is_evicted_for_one_that_needs_the_room(
        make_harness: MakeHarness) -> None:
    h = harness(make_harness, budget_mb=200)
    sink = h.sink()
    first = h.embed(sink, ["x"], model="a")
    await h.settle()
    (worker_a,) = h.workers("a")
    h.ready(worker_a)
    (job,) = h.job_ids(worker_a)
    h.reply_embeddings(worker_a, job, 1.0)
    h.want_work(worker_a)
    assert sink.finals(first)
    second = h.embed(sink, ["y"], model="b")  # b needs 150; only 50 are left
    await h.settle()
    assert h.launcher.stopped == [worker_a]
    assert h.workers("b")[0].state is not WorkerState.DEAD  # started once a's memory freed
    h.ready(h.workers("b")[0])
    (job_b,) = h.job_ids(h.workers("b")[0])
    h.reply_embeddings(h.workers("b")[0], job_b, 2.0)
    assert sink.finals(second)


async def test_busy_or_queued_workers_are_never_evicted(make_harness: MakeHarness) -> None:
    h = harness(make_harness, budget_mb=200)
    sink = h.sink()
    h.embed(sink, ["x"], model="a")
    await h.settle()
    (worker_a,) = h.workers("a")
    h.ready(worker_a)  # takes the job: busy
    h.embed(sink, ["y"], model="b", timeout_s=0.05)
    await h.settle()
    assert h.launcher.stopped == [] and h.workers("b") == []
    status = {m.key: m for m in build_status(h.pool, "/s", 0.0).models}
    assert status["b"].state == "waiting-for-memory"


async def test_load_keeps_a_warm_minimum_until_unload(make_harness: MakeHarness) -> None:
    h = harness(make_harness, budget_mb=10_000, cooldown_idle_s=60, max_workers_per_model=4)
    control.load_model(h.pool, "a", 2)
    await h.settle()
    workers = h.workers("a")
    assert len(workers) == 2
    for worker in workers:
        h.ready(worker)
    h.clock.advance(3600)
    h.pool.tick()
    assert h.launcher.stopped == []  # idle for an hour, but pinned by `load`
    control.unload_model(h.pool, "a")
    await h.settle()
    assert sorted(h.launcher.stopped, key=id) == sorted(workers, key=id)


async def test_a_worker_turning_idle_is_evicted_for_a_model_waiting_for_memory(
        make_harness: MakeHarness) -> None:
    h = harness(make_harness, budget_mb=200)
    sink = h.sink()
    h.embed(sink, ["x"], model="a")
    await h.settle()
    (worker_a,) = h.workers("a")
    h.ready(worker_a)
    (job,) = h.job_ids(worker_a)
    h.reply_embeddings(worker_a, job, 1.0)  # a's reply is in, its WantWork not yet
    second = h.embed(sink, ["y"], model="b")
    await h.settle()
    assert h.launcher.stopped == []  # a is still busy: nothing to evict
    h.want_work(worker_a)  # a turns idle: now it can make room for b
    await h.settle()
    assert h.launcher.stopped == [worker_a]
    (worker_b,) = h.workers("b")
    h.ready(worker_b)
    h.reply_embeddings(worker_b, h.job_ids(worker_b)[0], 2.0)
    assert sink.finals(second)
