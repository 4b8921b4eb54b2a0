"""Pool recovery with fakes and a fake clock: dead workers' jobs re-queued once, load
failures answered with their cause, back-off, and the failed state (test_pool.py covers
the request path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embeddings
from modelpool.protocol.pipes import Heartbeat, LoadFailed
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


# ---- deaths before Ready are not load failures ----------------------------------------


async def test_a_loading_worker_killed_by_a_signal_is_started_again_not_a_load_failure(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=1.0, max_load_failures=1)
    sink = h.sink()
    client_id = h.embed(sink, ["x"])
    await h.settle()
    for worker in h.workers("emb"):
        h.die(worker, -9)  # the OOM killer, say: no LoadFailed from the loader
    await h.settle()
    model = h.pool.models["emb"]
    assert sink.messages == [] and client_id in sink.jobs  # still waiting
    assert (model.failures.count, model.deaths.count) == (0, 1)
    assert model.state_name() != "failed" and len(h.launcher.started) == 2
    h.clock.advance(1.01)  # the back-off ends: the periodic tick starts workers again
    h.pool.tick()
    await h.settle()
    assert len(h.launcher.started) == 4
    worker = h.workers("emb")[2]
    h.ready(worker)
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
    (reply,) = sink.finals(client_id)
    assert isinstance(reply, Embeddings) and model.deaths.count == 0


async def test_a_worker_that_cannot_be_started_waits_and_retries(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=1.0, cold_start_workers=1)

    async def no_fds(handle: object, settings: object) -> None:
        raise OSError(24, "Too many open files")

    real_start, h.launcher.start = h.launcher.start, no_fds  # type: ignore[method-assign]
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=60)
    await h.settle()
    model = h.pool.models["emb"]
    assert model.deaths.count == 1 and "Too many open files" in (model.deaths.last_error or "")
    assert sink.messages == [] and model.failures.count == 0
    h.launcher.start = real_start  # type: ignore[method-assign]
    h.clock.advance(1.01)
    h.pool.tick()
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
    assert isinstance(sink.finals(client_id)[0], Embeddings)


async def test_a_timeout_while_workers_keep_dying_names_the_cause(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=5.0)
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=2)
    await h.settle()
    for worker in h.workers("emb"):
        h.die(worker, -9)
    h.clock.advance(2)
    error = sink.only_error(client_id)
    assert error.code is ErrorCode.TIMEOUT and "died while loading" in error.message


# ---- loads that never end -------------------------------------------------------------


async def _stuck_load(h: Harness, seconds: int, moving: bool) -> None:
    """Every worker of emb beats once a second while loading; its load progress moves
    or stands still."""
    for second in range(1, seconds + 1):
        h.clock.advance(1)
        for worker in h.workers("emb"):
            if worker.state is WorkerState.LOADING:
                h.pool.handle_heartbeat(worker, Heartbeat(seq=second,
                                                          progress=second if moving else 7))
        h.pool.check_health()
        await h.settle()


async def test_a_load_that_stands_still_fails_with_its_cause(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_stall_s=30, heartbeat_timeout_s=5)
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=1000)
    await h.settle()
    await _stuck_load(h, 29, moving=False)
    assert h.launcher.killed == []
    await _stuck_load(h, 3, moving=False)
    assert set(h.launcher.killed) == set(h.workers("emb")[:2])
    error = sink.only_error(client_id)
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "load_stall_s" in error.message
    assert h.pool.models["emb"].failures.count == 1


async def test_a_load_that_moves_runs_until_load_timeout(make_harness: MakeHarness) -> None:
    h = make_harness(load_stall_s=30, load_timeout_s=100, heartbeat_timeout_s=5)
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=1000)
    await h.settle()
    await _stuck_load(h, 95, moving=True)
    assert h.launcher.killed == []
    await _stuck_load(h, 10, moving=True)
    error = sink.only_error(client_id)
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "load_timeout_s" in error.message


# ---- load slots -----------------------------------------------------------------------


async def test_each_waiting_model_gets_a_load_slot_before_any_gets_a_second(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=2, cold_start_workers=2)
    h.generate(h.sink())
    await h.settle()
    _, second = h.workers("gen")  # one cold model took both slots
    h.embed(h.sink(), ["x"])
    await h.settle()
    # Its second load gives way to the other model's first.
    assert [w.model_key for w in h.launcher.started] == ["gen", "gen", "emb"]
    assert h.launcher.killed == [second] and h.pool.models["gen"].failures.count == 0
    assert h.pool.models["gen"].deaths.count == 0  # stopped by us: no failure at all


async def test_a_freed_load_slot_goes_to_a_model_without_a_worker_first(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=1, cold_start_workers=1, max_workers_per_model=2)
    h.generate(h.sink())
    h.generate(h.sink())  # waits for gen's first worker: gen will want a second
    h.embed(h.sink(), ["x"])  # waits for the one load slot
    await h.settle()
    assert [w.model_key for w in h.launcher.started] == ["gen"]
    h.ready(h.workers("gen")[0])  # busy at once: gen wants a second worker
    await h.settle()
    assert [w.model_key for w in h.launcher.started] == ["gen", "emb"]


async def test_a_warm_minimum_is_restored_when_a_back_off_ends(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=2.0)
    control.load_model(h.pool, "emb", 2)
    await h.settle()
    for worker in h.workers("emb"):
        h.die(worker, -9)  # both die while loading, no request waiting
    await h.settle()
    assert len(h.launcher.started) == 2  # backing off
    h.clock.advance(1)
    h.pool.tick()
    await h.settle()
    assert len(h.launcher.started) == 2
    h.clock.advance(1.01)
    h.pool.tick()
    await h.settle()
    assert len(h.launcher.started) == 4
