"""Pool recovery with fakes and a fake clock: dead workers' jobs re-queued once, load
failures answered with their cause, back-off, and the failed state (test_pool.py covers
the request path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embeddings
from modelpool.protocol.pipes import LoadFailed
from modelpool.supervisor import control
from modelpool.supervisor.workers import WorkerState
from modelpool.workers import exitcodes

if TYPE_CHECKING:
    from conftest import FakeSink, Harness

MakeHarness = Callable[..., "Harness"]


# ---- 8. worker death ----------------------------------------------------------------


async def _embed_on_first_worker(h: Harness, sink: FakeSink) -> tuple[int, int]:
    """Two embeds of 3 texts (max_batch 4: one per Work); the first runs on worker 0,
    the second waits. Returns their client ids."""
    first = h.embed(sink, ["a", "b", "c"])
    await h.settle()
    h.ready(h.workers("emb")[0])
    second = h.embed(sink, ["d", "e", "f"])
    return first, second


async def test_dead_workers_job_is_requeued_at_the_front_and_served_by_another(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_batch=4)
    sink = h.sink()
    first, second = await _embed_on_first_worker(h, sink)
    dying, other = h.workers("emb")
    ((job_id, _),) = h.items(h.works(dying)[0])

    h.die(dying, -9)
    assert sink.messages == []

    h.ready(other)
    assert [r.id for _, r in h.items(h.works(other)[0])] == [first]  # ahead of `second`
    h.reply_embeddings(other, job_id, 1.0)
    (reply,) = sink.finals(first)
    assert isinstance(reply, Embeddings)
    assert h.pool.models["emb"].failures.count == 0
    h.want_work(other)
    assert [r.id for _, r in h.items(h.works(other)[1])] == [second]


async def test_job_whose_retry_worker_also_dies_fails_worker_died(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_batch=4)
    sink = h.sink()
    first, second = await _embed_on_first_worker(h, sink)
    dying, other = h.workers("emb")
    h.die(dying, -9)
    h.ready(other)

    h.die(other, -9)

    error = sink.only_error(first)
    assert error.code is ErrorCode.WORKER_DIED
    assert "SIGKILL" in error.message and "retried" in error.message
    assert sink.finals(second) == []  # never ran, still waiting for a new worker
    await h.settle()
    assert len(h.launcher.started) > 2
    assert h.pool.models["emb"].live_workers()  # the waiting work is not stranded


async def test_stream_that_already_sent_chunks_fails_at_once_when_its_worker_dies(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.generate(sink)
    await h.settle()
    worker, other = h.workers("gen")
    h.ready(worker)
    ((job_id, _),) = h.items(h.works(worker)[0])
    h.chunk(worker, job_id, 0, "a")

    h.die(worker, -9)

    error = sink.only_error(client_id)
    assert error.code is ErrorCode.WORKER_DIED and "1 chunks" in error.message
    h.ready(other)
    assert h.works(other) == []


async def test_stream_without_chunks_is_retried_when_its_worker_dies(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.generate(sink, "again")
    await h.settle()
    worker, other = h.workers("gen")
    h.ready(worker)
    h.die(worker, exitcodes.INTERNAL_ERROR)
    h.ready(other)
    ((_, request),) = h.items(h.works(other)[0])
    assert request.prompt == "again"
    assert sink.messages == []


async def test_crash_after_ready_with_empty_info_is_not_a_load_failure(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_batch=4)
    sink = h.sink()
    first = h.embed(sink, ["a", "b", "c"])
    await h.settle()
    crashing, loading = h.workers("emb")
    h.ready(crashing, info={})  # a custom loader whose model has no info()
    second = h.embed(sink, ["d", "e", "f"])

    h.die(crashing, -9)

    assert sink.messages == []  # `second` must keep waiting for the loading sibling
    assert h.pool.models["emb"].failures.count == 0
    h.ready(loading)
    assert [r.id for _, r in h.items(h.works(loading)[0])] == [first]
    assert second in sink.jobs


# ---- 9. load failure ----------------------------------------------------------------


def _fail_load(h: Harness, model: str, cause: str) -> None:
    """Every live worker of the model reports LoadFailed and exits with LOAD_FAILED."""
    for worker in h.workers(model):
        if worker.state is not WorkerState.DEAD:
            h.pool.handle(worker, LoadFailed(cause=cause))
            h.die(worker, exitcodes.LOAD_FAILED)


async def test_load_failure_fails_waiting_requests_with_the_cause_then_backs_off(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=1.0)
    sinks = [h.sink(), h.sink()]
    ids = [h.embed(s, ["x"]) for s in sinks]
    await h.settle()

    _fail_load(h, "emb", "boom")

    for sink, client_id in zip(sinks, ids, strict=True):
        error = sink.only_error(client_id)
        assert error.code is ErrorCode.MODEL_LOAD_FAILED and "boom" in error.message
    assert h.pool.models["emb"].failures.count == 1  # two siblings, one attempt

    late = h.sink()
    h.embed(late, ["y"], id=50)
    await h.settle()
    error = late.only_error(50)
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "boom" in error.message
    assert len(h.launcher.started) == 2

    h.clock.advance(1.01)
    h.embed(late, ["z"], id=51)
    await h.settle()
    assert late.finals(51) == []
    assert len(h.launcher.started) == 4


async def test_model_is_failed_after_max_load_failures_until_load_model(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=1.0, max_load_failures=3)
    sink = h.sink()
    model = h.pool.models["emb"]
    for round_ in range(3):
        h.embed(sink, ["x"])
        await h.settle()
        assert len(h.launcher.started) == 2 * (round_ + 1)
        _fail_load(h, "emb", f"boom {round_}")
        h.clock.advance(10)
    assert model.state_name() == "failed"

    h.embed(sink, ["x"], id=99)
    await h.settle()
    error = sink.only_error(99)
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "3 times" in error.message
    assert len(h.launcher.started) == 6

    message = control.load_model(h.pool, "emb", 1)
    await h.settle()
    assert "emb" in message
    assert len(h.launcher.started) == 7
    assert model.state_name() == "loading"
    assert model.failures.count == 0
