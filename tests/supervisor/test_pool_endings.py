"""Requests that end before their worker answers, with fakes: timeouts, cancels and
clients that go away; and requests waiting for a load slot (test_pool.py covers the
normal request path)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Chunk
from modelpool.protocol.pipes import Abort
from modelpool.supervisor.queueing import Job, Requester
from modelpool.supervisor.workers import WorkerState

if TYPE_CHECKING:
    from conftest import FakeSink, Harness

MakeHarness = Callable[..., "Harness"]


# ---- 5. timeout ---------------------------------------------------------------------


async def test_timeout_while_loading_names_model_and_cause_and_drops_late_work(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.embed(sink, ["x"], timeout_s=0.05)
    await h.settle()
    h.clock.advance(0.1)

    error = sink.only_error(client_id)
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
    ((job_id, _),) = h.items(h.works(worker)[0])
    h.clock.advance(0.1)

    error = sink.only_error(client_id)
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
    assert sink.only_error(client_id).code is ErrorCode.CANCELLED

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
    ((job_id, _),) = h.items(h.works(worker)[0])
    h.chunk(worker, job_id, 0, "a")

    h.pool.cancel(sink, client_id)

    assert h.sent(worker)[-1] == Abort(job_id=job_id)
    h.chunk(worker, job_id, 1, "b")
    h.end(worker, job_id, "cancelled")
    assert sink.messages[0] == Chunk(id=client_id, seq=0, text="a")
    assert sink.only_error(client_id).code is ErrorCode.CANCELLED
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
    ((job_id, request),) = h.items(h.works(worker)[0])
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
    ((job_id, _),) = h.items(h.works(gen_worker)[0])
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
    assert [r.id for _, r in h.items(h.works(emb_worker)[0])] == [other_id]
    assert sink.messages == []


async def test_forget_sink_sends_nothing_even_before_the_connection_is_marked_closed(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=4)
    sink = h.sink()
    await _queued_embed_and_running_stream(h, sink)
    sink.messages.clear()

    h.pool.forget_sink(sink)  # the server's order: forget first, then conn.close()

    assert sink.messages == []


# ---- 8. what an ended request leaves behind ------------------------------------------


async def test_ended_requests_leave_no_cycles_for_the_garbage_collector(
        make_harness: MakeHarness) -> None:
    """Replied, timed out, cancelled, deduplicated, or its client gone: the request's
    Requester and Job are freed as their last reference goes. As cycles they
    waited for the collector, which then ran for a tenth of the supervisor's time."""
    h = make_harness()
    sink, gone = h.sink(), h.sink("gone")
    h.embed(sink, ["warm"])
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        replied = h.embed(sink, ["a"])
        twin = h.embed(sink, ["a"])  # joins the first: one job, two requesters
        cancelled = h.embed(sink, ["c"])
        timed_out = h.embed(sink, ["t"], timeout_s=0.05)
        h.embed(gone, ["g"])
        h.pool.cancel(sink, cancelled)
        h.clock.advance(0.1)
        h.pool.forget_sink(gone)
        h.want_work(worker)
        for job_id in h.job_ids(worker)[1:]:
            h.reply_embeddings(worker, job_id, 2.0)
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, Job | Requester)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
    assert [type(m).__name__ for m in sink.messages[1:]] == [
        "Error", "Error", "Embeddings", "Embeddings"]
    assert {m.id for m in sink.messages[1:]} == {replied, twin, cancelled, timed_out}


async def test_concurrent_loads_are_capped_across_models(make_harness: MakeHarness) -> None:
    h = make_harness(max_concurrent_loads=2)
    sink = h.sink()
    h.embed(sink, ["x"])
    h.generate(sink)
    await h.settle()
    loading = [w for w in h.launcher.started
               if w.state in (WorkerState.STARTING, WorkerState.LOADING)]
    assert sorted(w.model_key for w in loading) == ["emb", "gen"]  # one each, two in all
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
