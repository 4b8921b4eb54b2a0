"""The pool's batching, driven as the event loop would, with fake workers (conftest.py):
compatible waiting jobs go to a worker as one Work, a client's read is queued whole before
any of it is dispatched, and a Work's replies come back as one message after its WantWork."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from conftest import Harness

from modelpool.protocol.messages import Embeddings
from modelpool.protocol.pipes import Replies
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.workers import WorkerState

MakeHarness = Callable[..., Harness]


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
    batch = h.items(work)
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
    assert [r.id for _, r in h.items(h.works(worker)[1])] == [ids[3]]


async def test_a_works_replies_in_one_message_each_reach_their_own_sink(
        make_harness: MakeHarness) -> None:
    """As a worker sends them: its WantWork, then one Replies with the Work's replies."""
    h = make_harness(max_batch=4)
    sinks = [h.sink(f"c{i}") for i in range(3)]
    ids = [h.embed(sink, [text]) for sink, text in zip(sinks, "abc", strict=True)]
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    batch = h.items(h.works(worker)[0])
    h.want_work(worker)
    data = {job_id: struct.pack("<f", job_id) for job_id, _ in batch}
    h.pool.handle(worker, Replies(items=[Embeddings(id=job_id, data=data[job_id], shape=[1, 1])
                                         for job_id, _ in batch]))
    for sink, client_id, (job_id, _) in zip(sinks, ids, batch, strict=True):
        (reply,) = sink.messages
        assert isinstance(reply, Embeddings)
        assert (reply.id, reply.data) == (client_id, data[job_id])
    assert worker.state is WorkerState.IDLE and not worker.jobs


async def test_requests_read_together_go_to_a_free_worker_as_one_batch(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_batch=8)
    sink = h.sink()
    h.embed(sink, ["first"])
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    ((job_id, _),) = h.items(h.works(worker)[0])
    h.reply_embeddings(worker, job_id, 0.5)
    h.want_work(worker)  # free again

    with h.pool.admitting():  # as a connection's read of three frames
        ids = [h.embed(sink, [text]) for text in ("a", "b", "c")]
        assert len(h.works(worker)) == 1  # nothing sent before the read is done
    assert [r.id for _, r in h.items(h.works(worker)[1])] == ids

    for job_id, _ in h.items(h.works(worker)[1]):
        h.reply_embeddings(worker, job_id, 0.5)
    h.want_work(worker)
    lone = h.embed(sink, ["alone"])  # outside a read: dispatched at once, as before
    assert [r.id for _, r in h.items(h.works(worker)[2])] == [lone]


async def test_a_want_work_before_its_replies_gets_the_next_batch_at_once(
        make_harness: MakeHarness) -> None:
    """As a worker writes them: its WantWork, then the replies of the Work it ran."""
    h = make_harness(max_batch=2, max_batch_wait_ms=50)
    sink = h.sink()
    ids = [h.embed(sink, [text]) for text in ("a", "b", "c")]
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    ran = h.items(h.works(worker)[0])
    h.want_work(worker)
    # "c" goes before the replies are read, without waiting to fill: nothing else runs.
    assert [r.id for _, r in h.items(h.works(worker)[1])] == [ids[2]]
    for job_id, _ in ran:
        h.reply_embeddings(worker, job_id, 0.5)
    assert [m.id for m in sink.messages] == ids[:2]
    assert worker.state is WorkerState.BUSY  # "c" runs
    h.want_work(worker)
    ((job_id, _),) = h.items(h.works(worker)[1])
    h.reply_embeddings(worker, job_id, 0.5)
    assert [m.id for m in sink.messages] == ids
    assert worker.state is WorkerState.IDLE and worker.jobs == {}


async def test_generate_is_never_batched(make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.generate(sink, "one")
    h.generate(sink, "two")
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    (work,) = h.works(worker)
    assert [r.prompt for _, r in h.items(work)] == ["one"]


async def test_a_batchs_run_time_counts_once_in_the_models_service_time(
        make_harness: MakeHarness) -> None:
    """service_s is a moving average of a dispatch's run time (the retry hint divides it
    by the mean batch): a Work of four jobs is one sample, not four."""
    h = make_harness(max_batch=4)
    sink = h.sink()
    model = h.pool.models["emb"]
    for seconds in (1.0, 3.0):
        with h.pool.admitting():  # one read: one batch
            for text in "abcd":
                h.embed(sink, [text])
        await h.settle()
        worker = h.workers("emb")[0]
        if worker.state is WorkerState.LOADING:
            h.ready(worker)
        (work,) = h.works(worker)[-1:]
        assert len(h.items(work)) == 4
        h.clock.advance(seconds)
        h.want_work(worker)
        h.pool.handle(worker, Replies(items=[Embeddings(id=job_id, data=struct.pack("<f", 0),
                                                        shape=[1, 1])
                                             for job_id, _ in h.items(work)]))
    assert len(sink.messages) == 8
    assert model.metrics.service_s == pytest.approx(0.9 * 1.0 + 0.1 * 3.0)  # four: 1.69


async def test_results_carry_the_models_key_whatever_name_the_request_used(
        make_harness: MakeHarness) -> None:
    """The key, not the alias the client wrote: whole, joined to a twin, or in parts."""
    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     aliases=["small"], weights_mb=10, per_worker_mb=10)
    h = make_harness(models=[spec], max_batch=2)
    sink = h.sink()
    whole, twin = h.embed(sink, ["a"], model="small"), h.embed(sink, ["a"], model="small")
    split = h.embed(sink, ["b", "c", "d"], model="small")  # parts of 2 and 1
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    for _ in range(3):  # three Works: the pair joined, two texts, one text
        for job_id, request in h.items(h.works(worker)[-1]):
            h.reply_embeddings(worker, job_id, *[1.0] * len(request.texts))
        h.want_work(worker)
    assert {reply.id: reply.model for reply in sink.messages} == {
        whole: "emb", twin: "emb", split: "emb"}
