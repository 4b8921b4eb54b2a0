"""Pool policy and bookkeeping, driven as the event loop would, with fake workers.

The fakes live in conftest.py: the test plays each worker through
pool.on_worker_message / pool.on_worker_exit and each client through a FakeSink.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from protocol.errors import ErrorCode
from protocol.messages import ChatMessage, Chunk, Embed, Embeddings, End, Error, Generate
from protocol.pipes import Abort, LoadFailed, Work
from supervisor import management
from supervisor.workers import WorkerState
from workers import exitcodes

if TYPE_CHECKING:
    from conftest import FakeSink, Harness

MakeHarness = Callable[..., "Harness"]


def only_error(sink: FakeSink, client_id: int) -> Error:
    """The one final reply of a request, which must be an Error."""
    (reply,) = sink.finals(client_id)
    assert isinstance(reply, Error), reply
    return reply


def items_of(work: Work) -> list[tuple[int, Any]]:
    return [(item.job_id, item.request) for item in work.items]


# ---- 1. lazy activation -------------------------------------------------------------


async def test_no_worker_until_first_request_then_cold_start_of_that_model_only(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    await h.settle()
    assert h.launcher.started == []

    h.embed(sink, ["hello"], id=77)
    await h.settle()

    assert [w.model_key for w in h.launcher.started] == ["emb", "emb"]
    assert [s.spec.key for s in h.launcher.settings] == ["emb", "emb"]
    assert h.workers("gen") == []
    assert all(w.state is WorkerState.LOADING for w in h.launcher.started)
    assert sink.messages == []


async def test_request_goes_to_first_ready_worker_and_reply_carries_client_id(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.embed(sink, ["hello"], id=77)
    await h.settle()
    first, second = h.workers("emb")

    h.ready(second)  # the second one to be started is the first to be ready
    assert h.works(first) == []
    (work,) = h.works(second)
    ((job_id, request),) = items_of(work)
    assert request.texts == ["hello"] and job_id != 77

    h.reply_embeddings(second, job_id, 0.5, 0.25)
    (reply,) = sink.messages
    assert isinstance(reply, Embeddings)
    assert (reply.id, reply.model, reply.shape) == (77, "emb", [1, 2])
    assert sink.jobs == {}
    assert h.pool.models["emb"].metrics.by_priority["normal"].completed == 1


# ---- 2. batching --------------------------------------------------------------------


async def test_queued_embeds_coalesce_up_to_max_batch_and_rows_go_to_their_own_sink(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_batch=5)
    sinks = [h.sink(f"c{i}") for i in range(4)]
    texts = [["a", "b"], ["c"], ["d", "e"], ["f"]]
    ids = [h.embed(sink, t) for sink, t in zip(sinks, texts, strict=True)]
    await h.settle()
    worker = h.workers("emb")[0]

    h.ready(worker)
    (work,) = h.works(worker)
    batch = items_of(work)
    assert [r.id for _, r in batch] == ids[:3]  # 2 + 1 + 2 texts = max_batch; "f" waits
    assert sum(len(r.texts) for _, r in batch) == 5

    sent = {job_id: h.reply_embeddings(worker, job_id, float(job_id), 0.5)
            for job_id, _ in reversed(batch)}  # replies may come in any order
    for sink, client_id, (job_id, _) in zip(sinks, ids, batch, strict=False):
        (reply,) = sink.messages
        assert isinstance(reply, Embeddings)
        assert (reply.id, reply.data) == (client_id, sent[job_id])
    assert sinks[3].messages == []

    h.want_work(worker)
    assert [r.id for _, r in items_of(h.works(worker)[1])] == [ids[3]]


async def test_generate_is_never_batched(make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.generate(sink, "one")
    h.generate(sink, "two")
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    (work,) = h.works(worker)
    assert [r.prompt for _, r in items_of(work)] == ["one"]


# ---- 3. streaming -------------------------------------------------------------------


async def test_stream_chunks_forwarded_in_order_and_second_end_ignored(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.generate(sink, "tell me", id=9)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    ((job_id, request),) = items_of(h.works(worker)[0])
    assert isinstance(request, Generate) and request.prompt == "tell me"

    for seq, text in enumerate(["a", "b", "c"]):
        h.chunk(worker, job_id, seq, text)
    h.end(worker, job_id)
    h.end(worker, job_id)
    h.chunk(worker, job_id, 3, "late")

    assert sink.messages[:3] == [Chunk(id=client_id, seq=s, text=t)
                                 for s, t in enumerate(["a", "b", "c"])]
    (final,) = sink.finals(client_id)
    assert isinstance(final, End)
    assert (final.finish_reason, final.model, final.completion_tokens) == ("stop", "gen", 3)
    assert len(sink.messages) == 4
    assert h.pool.models["gen"].metrics.by_priority["normal"].completed == 1


# ---- 4. admission -------------------------------------------------------------------


@pytest.mark.parametrize(("request_", "code"), [
    (Embed(id=1, model="nope", texts=["x"]), ErrorCode.UNKNOWN_MODEL),
    (Embed(id=1, model="gen", texts=["x"]), ErrorCode.WRONG_CAPABILITY),
    (Generate(id=1, model="emb", prompt="x"), ErrorCode.WRONG_CAPABILITY),
    (Generate(id=1, model="gen"), ErrorCode.BAD_REQUEST),
])
async def test_admission_errors_reply_at_once_and_start_nothing(
        make_harness: MakeHarness, request_: Embed | Generate, code: ErrorCode) -> None:
    h = make_harness()
    sink = h.sink()
    h.pool.submit(sink, request_)
    await h.settle()
    assert only_error(sink, 1).code is code
    assert h.launcher.started == []
    assert sink.jobs == {}


async def test_generate_with_messages_and_no_prompt_is_accepted(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.pool.submit(sink, Generate(id=1, model="gen",
                                 messages=[ChatMessage(role="user", content="hi")]))
    await h.settle()
    assert sink.messages == []
    assert len(h.workers("gen")) == 2


async def test_duplicate_in_flight_id_on_one_sink_is_bad_request(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink, other = h.sink("a"), h.sink("b")
    h.embed(sink, ["x"], id=5)
    await h.settle()
    started = len(h.launcher.started)

    h.embed(sink, ["y"], id=5)
    h.embed(other, ["z"], id=5)  # ids are per connection
    await h.settle()

    error = only_error(sink, 5)
    assert error.code is ErrorCode.BAD_REQUEST and "5" in error.message
    assert other.messages == [] and 5 in other.jobs
    assert len(h.launcher.started) == started
    assert len(h.pool.models["emb"].queue) == 2


async def test_shutting_down_refuses_new_work(make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.pool.shutting_down = True
    h.embed(sink, ["x"], id=3)
    await h.settle()
    assert only_error(sink, 3).code is ErrorCode.SHUTTING_DOWN
    assert h.launcher.started == []


# ---- 5. timeout ---------------------------------------------------------------------


async def test_timeout_while_loading_names_model_and_cause_and_drops_late_work(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=0.05)
    await asyncio.sleep(0.1)

    error = only_error(sink, client_id)
    assert error.code is ErrorCode.TIMEOUT
    assert "'emb'" in error.message and "still loading" in error.message
    assert len(h.pool.models["emb"].queue) == 0 and sink.jobs == {}

    worker = h.workers("emb")[0]
    h.ready(worker)  # ready after the client gave up: the job must not run
    assert h.works(worker) == []
    h.reply_embeddings(worker, 1, 1.0)  # a stray reply for that job id
    assert len(sink.messages) == 1


async def test_timeout_while_running_then_late_reply_is_dropped(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=0.05)
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    ((job_id, _),) = items_of(h.works(worker)[0])
    await asyncio.sleep(0.1)

    error = only_error(sink, client_id)
    assert error.code is ErrorCode.TIMEOUT and f"pid {worker.pid}" in error.message
    h.reply_embeddings(worker, job_id, 1.0)
    assert len(sink.messages) == 1
    counters = h.pool.models["emb"].metrics.by_priority["normal"]
    assert counters.failed == 1 and counters.completed == 0


# ---- 6. cancel ----------------------------------------------------------------------


async def test_cancel_queued_job_replies_cancelled_and_never_dispatches_it(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.embed(sink, ["x"])
    await h.settle()

    h.pool.cancel(sink, client_id)
    h.pool.cancel(sink, client_id)  # a second cancel finds nothing
    assert only_error(sink, client_id).code is ErrorCode.CANCELLED

    for worker in h.workers("emb"):
        h.ready(worker)
        assert h.works(worker) == []
    assert len(h.pool.models["emb"].queue) == 0


async def test_cancel_running_stream_aborts_worker_and_drops_later_output(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.generate(sink)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    ((job_id, _),) = items_of(h.works(worker)[0])
    h.chunk(worker, job_id, 0, "a")

    h.pool.cancel(sink, client_id)

    assert h.sent(worker)[-1] == Abort(job_id=job_id)
    h.chunk(worker, job_id, 1, "b")
    h.end(worker, job_id, "cancelled")
    assert sink.messages[0] == Chunk(id=client_id, seq=0, text="a")
    assert only_error(sink, client_id).code is ErrorCode.CANCELLED
    assert len(sink.messages) == 2
    assert worker.jobs == {}


async def test_cancelled_job_behind_the_head_is_not_batched(make_harness: MakeHarness) -> None:
    h = make_harness()
    keep, drop = h.sink("keep"), h.sink("drop")
    kept = h.embed(keep, ["a"])
    dropped = h.embed(drop, ["b"])
    await h.settle()
    h.pool.cancel(drop, dropped)

    worker = h.workers("emb")[0]
    h.ready(worker)
    ((job_id, request),) = items_of(h.works(worker)[0])
    assert request.id == kept
    h.reply_embeddings(worker, job_id, 1.0)
    assert len(drop.finals(dropped)) == 1
    assert len(h.pool.models["emb"].queue) == 0


# ---- 7. client gone -----------------------------------------------------------------


async def _queued_embed_and_running_stream(h: Harness, sink: FakeSink) -> tuple[int, Any]:
    """sink gets a queued Embed and a running Generate; returns (gen job id, gen worker)."""
    h.embed(sink, ["x"])
    h.generate(sink)
    await h.settle()
    gen_worker = h.workers("gen")[0]
    h.ready(gen_worker)
    ((job_id, _),) = items_of(h.works(gen_worker)[0])
    h.chunk(gen_worker, job_id, 0, "a")
    return job_id, gen_worker


async def test_forget_sink_frees_queued_work_and_aborts_streams(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=4)
    sink, bystander = h.sink("gone"), h.sink("stays")
    job_id, gen_worker = await _queued_embed_and_running_stream(h, sink)
    other_id = h.embed(bystander, ["y"])  # behind the gone client's embed
    sink.messages.clear()

    sink.closed = True
    h.pool.forget_sink(sink)

    assert Abort(job_id=job_id) in h.sent(gen_worker)
    assert sink.jobs == {}
    h.chunk(gen_worker, job_id, 1, "b")
    h.end(gen_worker, job_id)
    emb_worker = h.workers("emb")[0]
    h.ready(emb_worker)
    assert [r.id for _, r in items_of(h.works(emb_worker)[0])] == [other_id]
    assert sink.messages == []


async def test_forget_sink_sends_nothing_even_before_the_connection_is_marked_closed(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=4)
    sink = h.sink()
    await _queued_embed_and_running_stream(h, sink)
    sink.messages.clear()

    h.pool.forget_sink(sink)  # the server's order: forget first, then conn.close()

    assert sink.messages == []


async def test_concurrent_loads_are_capped_across_models(make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=2)
    sink = h.sink()
    h.embed(sink, ["x"])
    h.generate(sink)
    await h.settle()
    assert [w.model_key for w in h.launcher.started] == ["emb", "emb"]
    assert sink.messages == []


async def test_model_waiting_for_a_load_slot_starts_when_one_frees(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=2)
    sink = h.sink()
    h.embed(sink, ["x"])
    h.generate(sink)
    await h.settle()

    h.ready(h.workers("emb")[0])  # one emb load done: one load slot is free
    await h.settle()

    assert len(h.workers("gen")) == 1


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
    ((job_id, _),) = items_of(h.works(dying)[0])

    h.die(dying, -9)
    assert sink.messages == []

    h.ready(other)
    assert [r.id for _, r in items_of(h.works(other)[0])] == [first]  # ahead of `second`
    h.reply_embeddings(other, job_id, 1.0)
    (reply,) = sink.finals(first)
    assert isinstance(reply, Embeddings)
    assert h.pool.models["emb"].load_failures == 0
    h.want_work(other)
    assert [r.id for _, r in items_of(h.works(other)[1])] == [second]


async def test_job_whose_retry_worker_also_dies_fails_worker_died(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_batch=4)
    sink = h.sink()
    first, second = await _embed_on_first_worker(h, sink)
    dying, other = h.workers("emb")
    h.die(dying, -9)
    h.ready(other)

    h.die(other, -9)

    error = only_error(sink, first)
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
    ((job_id, _),) = items_of(h.works(worker)[0])
    h.chunk(worker, job_id, 0, "a")

    h.die(worker, -9)

    error = only_error(sink, client_id)
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
    ((_, request),) = items_of(h.works(other)[0])
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
    assert h.pool.models["emb"].load_failures == 0
    h.ready(loading)
    assert [r.id for _, r in items_of(h.works(loading)[0])] == [first]
    assert second in sink.jobs


# ---- 9. load failure ----------------------------------------------------------------


def _fail_load(h: Harness, model: str, cause: str) -> None:
    """Every live worker of the model reports LoadFailed and exits with LOAD_FAILED."""
    for worker in h.workers(model):
        if worker.state is not WorkerState.DEAD:
            h.pool.on_worker_message(worker, LoadFailed(cause=cause))
            h.die(worker, exitcodes.LOAD_FAILED)


async def test_load_failure_fails_waiting_requests_with_the_cause_then_backs_off(
        make_harness: MakeHarness) -> None:
    h = make_harness(load_backoff_s=1.0)
    sinks = [h.sink(), h.sink()]
    ids = [h.embed(s, ["x"]) for s in sinks]
    await h.settle()

    _fail_load(h, "emb", "boom")

    for sink, client_id in zip(sinks, ids, strict=True):
        error = only_error(sink, client_id)
        assert error.code is ErrorCode.MODEL_LOAD_FAILED and "boom" in error.message
    assert h.pool.models["emb"].load_failures == 1  # two siblings, one attempt

    late = h.sink()
    h.embed(late, ["y"], id=50)
    await h.settle()
    error = only_error(late, 50)
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
    assert management.model_state(h.pool, model) == "failed"

    h.embed(sink, ["x"], id=99)
    await h.settle()
    error = only_error(sink, 99)
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "3 times" in error.message
    assert len(h.launcher.started) == 6

    message = management.load_model(h.pool, "emb", 1)
    await h.settle()
    assert "emb" in message
    assert len(h.launcher.started) == 7
    assert management.model_state(h.pool, model) == "loading"
    assert model.load_failures == 0


# ---- 10. scale up -------------------------------------------------------------------


async def test_scale_up_one_at_a_time_when_all_busy_up_to_the_cap(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_workers_per_model=3)
    sink = h.sink()
    h.embed(sink, ["1"])
    await h.settle()
    a, b = h.workers("emb")
    h.ready(a)
    h.ready(b)
    h.embed(sink, ["2"])
    assert a.state is WorkerState.BUSY and b.state is WorkerState.BUSY

    h.embed(sink, ["3"])
    await h.settle()
    assert len(h.launcher.started) == 3  # all busy and work waits: +1
    h.embed(sink, ["4"])
    await h.settle()
    assert len(h.launcher.started) == 3  # one start at a time

    c = h.workers("emb")[2]
    h.ready(c)
    assert [r.texts for _, r in items_of(h.works(c)[0])] == [["3"], ["4"]]
    h.embed(sink, ["5"])
    await h.settle()
    assert len(h.launcher.started) == 3  # at max_workers_per_model
    assert len(h.pool.models["emb"].queue) == 1


async def test_scale_up_when_work_still_waits_after_cold_start_workers_took_theirs(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_workers_per_model=4)
    sink = h.sink()
    for n in range(3):
        h.generate(sink, f"p{n}")  # a burst while the model loads
    await h.settle()
    a, b = h.workers("gen")
    h.ready(a)
    h.ready(b)
    assert a.state is WorkerState.BUSY and b.state is WorkerState.BUSY
    assert len(h.pool.models["gen"].queue) == 1
    await h.settle()

    assert len(h.workers("gen")) == 3


async def test_scale_up_respects_per_model_max_workers(make_harness: MakeHarness) -> None:
    from registry.spec import ModelSpec

    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     max_workers=1)
    h = make_harness(models=[spec])
    sink = h.sink()
    h.embed(sink, ["1"])
    h.embed(sink, ["2"])
    await h.settle()
    assert len(h.launcher.started) == 1
    h.ready(h.workers("emb")[0])
    h.embed(sink, ["3"])
    await h.settle()
    assert len(h.launcher.started) == 1
