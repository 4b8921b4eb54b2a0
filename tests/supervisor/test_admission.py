"""Admission and queueing policy through the real Pool with fakes: bounds, deadlines,
dedup, priorities, ageing, batch waiting, metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from test_queueing import drain

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embed, Embeddings, Error
from modelpool.protocol.status import ModelStatus
from modelpool.supervisor.owners import Tenant
from modelpool.supervisor.status import build_status

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Harness

    MakeHarness = Callable[..., Harness]


def model_status(h: Harness, key: str = "emb") -> ModelStatus:
    return next(m for m in build_status(h.pool, "/s", 0.0).models if m.key == key)


async def one_busy_worker(h: Harness, model: str = "emb") -> None:
    """A single ready worker, busy with a first request, so later ones queue."""
    if model == "emb":
        h.embed(h.sink("first"), ["first"])
    else:
        h.generate(h.sink("first"))
    await h.settle()
    (worker,) = h.workers(model)
    h.ready(worker)


async def test_queue_full_and_overloaded_answer_at_once(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_queue=3, max_queued_total=5)
    await one_busy_worker(h)
    sink = h.sink()
    ids = [h.embed(sink, [f"t{i}"]) for i in range(4)]
    (full,) = sink.errors()
    assert full.id == ids[3] and full.code is ErrorCode.QUEUE_FULL
    assert full.retry_after_s is not None and full.retry_after_s > 0
    for i in range(2):
        h.generate(sink, prompt=f"p{i}")  # gen: its own queue, counted in the global bound
    await h.settle()
    h.generate(sink, prompt="one too many")
    overloaded = sink.errors()[-1]
    assert overloaded.code is ErrorCode.OVERLOADED
    stats = {p.priority: p for p in model_status(h).priorities}
    assert stats["normal"].rejected == {"QUEUE_FULL": 1}


async def test_identical_requests_run_once_and_each_gets_the_answer(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    await one_busy_worker(h)
    sinks = [h.sink(f"c{i}") for i in range(20)]
    ids = [h.embed(sink, ["same text"]) for sink in sinks]
    assert len(h.pool.models["emb"].queue) == 1  # one job for twenty requesters
    (worker,) = h.workers("emb")
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)  # finishes the first request
    h.want_work(worker)
    (job_id,) = h.job_ids(worker)[1:]
    h.reply_embeddings(worker, job_id, 7.0)
    for sink, client_id in zip(sinks, ids, strict=True):
        (reply,) = sink.finals(client_id)
        assert isinstance(reply, Embeddings) and reply.id == client_id
    emb = model_status(h)
    assert emb.priorities[0].deduplicated == 19


async def test_tenants_of_one_connection_take_turns_and_still_share_identical_work(
        make_harness: MakeHarness) -> None:
    """The HTTP front door's clients share its few connections: each names its tenant,
    which takes a turn of its own among its user's clients, whichever connection carries
    it; a connection's requests that name none keep its own turn."""
    h = make_harness(cold_start_workers=1)
    await one_busy_worker(h)
    front, other = h.sink(), h.sink()
    front.owner, other.owner = (1000, 1), (1000, 2)  # two connections of one user
    for i in range(6):
        h.embed(front, [f"flood {i}"], tenant="flooder")
    h.embed(front, ["polite"], tenant="polite")
    h.embed(other, ["also polite"], tenant="polite")
    h.embed(front, ["flood 0"], tenant="polite")  # joins the flooder's identical job
    h.embed(front, ["plain"])
    queue = h.pool.models["emb"].queue
    assert len(queue) == 9
    owners = [job.owner for job in drain(queue)]
    assert owners[:3].count(Tenant(1000, "polite")) == 1
    assert owners.count(Tenant(1000, "polite")) == 2
    assert owners[:3].count((1000, 1)) == 1  # the connection's own turn, for "plain"
    assert owners.count(Tenant(1000, "flooder")) == 6


async def test_no_tenant_takes_the_last_quarter_of_its_users_share(
        make_harness: MakeHarness) -> None:
    """One HTTP key's flood leaves room in the queue for the front door's other keys, as
    one user's flood leaves room for other users."""
    h = make_harness(cold_start_workers=1, max_queue=16)  # a user's share 12, a tenant's 9
    await one_busy_worker(h)
    front, other_user = h.sink(), h.sink()
    front.owner, other_user.owner = (1000, 1), (2000, 1)
    ids = [h.embed(front, [f"flood {i}"], tenant="flooder") for i in range(10)]
    (full,) = front.errors()
    assert full.id == ids[9] and full.code is ErrorCode.QUEUE_FULL and "tenant" in full.message
    ids = [h.embed(front, [f"polite {i}"], tenant="polite") for i in range(4)]
    (user_full,) = front.errors()[1:]  # 9 + 3 = the user's 12
    assert user_full.id == ids[3] and "user" in user_full.message
    h.embed(other_user, ["another user"], tenant="flooder")  # another user's tenant
    assert len(front.errors()) == 2 and not other_user.errors()
    queue = h.pool.models["emb"].queue
    assert len(queue) == 13
    while queue.pop_batch(32):
        pass
    assert queue.held == {}  # taken in batches, each tenant's count went with them


async def test_cancelling_one_requester_leaves_the_others(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    await one_busy_worker(h, "gen")
    a, b = h.sink("a"), h.sink("b")
    id_a = h.generate(a, prompt="same", temperature=0.0)
    id_b = h.generate(b, prompt="same", temperature=0.0)
    h.pool.cancel(a, id_a)
    (cancelled,) = a.finals(id_a)
    assert cancelled.code is ErrorCode.CANCELLED
    (worker,) = h.workers("gen")
    h.end(worker, h.job_ids(worker)[0])
    h.want_work(worker)
    job_id = h.job_ids(worker)[-1]
    h.chunk(worker, job_id, 0, "hello")
    h.end(worker, job_id)
    assert [m.text for m in b.messages if hasattr(m, "text")] == ["hello"]
    assert len(b.finals(id_b)) == 1 and a.finals(id_a) == [cancelled]


async def test_sampling_without_a_seed_is_never_deduplicated(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    await one_busy_worker(h, "gen")
    sink = h.sink()
    h.generate(sink, prompt="same", temperature=0.8)
    h.generate(sink, prompt="same", temperature=0.8)
    assert len(h.pool.models["gen"].queue) == 2


async def test_priority_order_and_ageing(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, priority_aging_s=10, max_batch=1)
    await one_busy_worker(h)
    sink = h.sink()
    low = h.embed(sink, ["low"], priority="batch")
    for _ in range(2):  # batch starves 10 s (up to low), then low starves 10 s (to normal)
        h.pool.tick()
        h.clock.advance(10)
    h.pool.tick()
    high = h.embed(sink, ["high"], priority="high")
    normal = h.embed(sink, ["normal"], priority="normal")
    (worker,) = h.workers("emb")
    order = []
    for _ in range(3):
        h.reply_embeddings(worker, h.job_ids(worker)[-1], 0.0)
        h.want_work(worker)
        order.append(h.works(worker)[-1].items[0].request.id)
    assert order == [high, low, normal]  # aged batch is now ahead of the later normal


async def test_a_backlog_earns_no_place_ahead_of_others_by_waiting(
        make_harness: MakeHarness) -> None:
    """A level that is being served does not age: a flood waiting behind its own
    earlier requests keeps taking turns with other users' fresh ones."""
    h = make_harness(cold_start_workers=1, priority_aging_s=10, max_batch=1)
    await one_busy_worker(h)
    flood, polite = h.sink("flood"), h.sink("polite")
    for i in range(30):
        h.embed(flood, [f"f{i}"])
    (worker,) = h.workers("emb")

    def serve_one() -> str:
        h.reply_embeddings(worker, h.job_ids(worker)[-1], 0.0)
        h.want_work(worker)
        return str(h.works(worker)[-1].items[0].request.texts[0])

    for _ in range(15):  # one a second: the flood's rest has waited 15 s by then
        serve_one()
        h.clock.advance(1)
        h.pool.tick()
    h.embed(polite, ["p"])
    assert [serve_one() for _ in range(2)] == ["p", "f15"]


async def test_expired_work_never_reaches_a_worker(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    await one_busy_worker(h)
    sink = h.sink()
    late = h.embed(sink, ["late"], deadline_s=0.01)
    gone = h.embed(sink, ["already"], deadline_s=1.0, sent_at=h.clock.wall() - 5)
    h.clock.advance(0.05)
    (worker,) = h.workers("emb")
    h.reply_embeddings(worker, h.job_ids(worker)[0], 0.0)
    h.want_work(worker)
    assert len(h.job_ids(worker)) == 1  # nothing more was dispatched
    for client_id in (late, gone):
        (error,) = sink.finals(client_id)
        assert isinstance(error, Error) and error.code is ErrorCode.DEADLINE_EXPIRED


async def test_under_load_a_small_batch_waits_to_fill(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=2, max_batch_wait_ms=20, max_batch=8)
    sink = h.sink()
    h.embed(sink, ["a"])
    await h.settle()
    first, second = h.workers("emb")
    h.ready(first)  # busy with "a"
    h.ready(second)
    h.embed(sink, ["b"])
    assert h.works(second) == []  # the other worker is busy: wait for company
    h.embed(sink, ["c"])
    h.clock.advance(0.05)
    (work,) = h.works(second)
    assert [i.request.texts for i in work.items] == [["b"], ["c"]]
    emb = model_status(h)
    assert emb.mean_batch == 1.5  # batches of 1 and 2


async def test_a_sibling_that_has_replied_is_not_waited_for(make_harness: MakeHarness) -> None:
    """A worker's reply and its next WantWork are two frames (sent in one write, but
    they may still be read apart): a lone client's next request can land between them.
    The worker runs nothing then, so the request neither waits for a batch to fill nor
    gives up the replied worker's cores."""
    h = make_harness(cold_start_workers=2, max_batch_wait_ms=20, max_batch=8)
    h.pool.dispatcher.threads.cpus = 2  # type: ignore[union-attr]
    sink = h.sink()
    h.embed(sink, ["a"])
    await h.settle()
    first, second = h.workers("emb")
    h.ready(first)
    h.ready(second)
    h.reply_embeddings(first, h.job_ids(first)[0], 0.0)  # its WantWork is still on the way
    h.embed(sink, ["b"])
    (work,) = h.works(second)  # at once, no batch wait
    assert [i.request.texts for i in work.items] == [["b"]] and work.threads == 2


async def test_waiting_bytes_are_bounded(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_queued_bytes=1000)
    await one_busy_worker(h)
    sink = h.sink()
    h.pool.submit(sink, Embed(id=901, model="emb", texts=["a"]), nbytes=600)
    h.pool.submit(sink, Embed(id=902, model="emb", texts=["b"]), nbytes=600)  # 1200 > 1000
    (error,) = sink.errors()
    assert error.id == 902 and error.code is ErrorCode.OVERLOADED
    assert h.pool.queued_totals.nbytes == 600
    h.pool.cancel(sink, 901)
    assert h.pool.queued_totals.nbytes == 0  # released with the request
    h.pool.submit(sink, Embed(id=903, model="emb", texts=["c"]), nbytes=900)
    assert len(sink.errors()) == 2  # 903 fits again; the second error is 901's CANCELLED


async def test_a_request_larger_than_max_batch_is_spread_over_workers(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=2, max_batch=4)
    sink = h.sink()
    client_id = h.embed(sink, [f"t{i}" for i in range(10)])
    assert len(h.pool.models["emb"].queue) == 3  # parts of 4, 4 and 2 texts
    await h.settle()
    first, second = h.workers("emb")
    h.ready(first)
    h.ready(second)
    (work_a,), (work_b,) = h.works(first), h.works(second)
    assert [len(i.request.texts) for i in work_a.items + work_b.items] == [4, 4]
    h.pool.handle(second, Embeddings(id=work_b.items[0].job_id,
                                  data=bytes(range(4)) * 4, shape=[4, 1]))
    h.want_work(second)  # takes the last part
    (last,) = h.works(second)[1].items
    h.pool.handle(first, Embeddings(id=work_a.items[0].job_id,
                                 data=bytes(range(4, 8)) * 4, shape=[4, 1]))
    assert sink.finals(client_id) == []  # one part still out
    h.pool.handle(second, Embeddings(id=last.job_id, data=b"\xff" * 8, shape=[2, 1]))
    (reply,) = sink.finals(client_id)
    assert reply.shape == [10, 1]  # rows in request order, whatever order parts finished
    assert reply.data == bytes(range(4, 8)) * 4 + bytes(range(4)) * 4 + b"\xff" * 8


async def test_a_failing_part_fails_the_request_and_drops_the_rest(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_batch=4)
    sink = h.sink()
    client_id = h.embed(sink, [f"t{i}" for i in range(12)])
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    (item,) = h.works(worker)[0].items
    h.pool.handle(worker, Error(id=item.job_id, code=ErrorCode.MODEL_ERROR,
                                           message="bad text"))
    (error,) = sink.finals(client_id)
    assert error.code is ErrorCode.MODEL_ERROR
    assert len(h.pool.models["emb"].queue) == 0  # the other parts will never run
    h.want_work(worker)
    assert len(h.works(worker)) == 1


# ---- fairness between clients ---------------------------------------------------------


async def test_a_client_cannot_take_the_last_quarter_of_a_queue(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_queue=8)
    await one_busy_worker(h)
    flood, polite = h.sink("flood"), h.sink("polite")
    for i in range(7):
        h.embed(flood, [f"f{i}"])
    (error,) = flood.errors()  # 6 waiting: the 7th is refused
    assert error.code is ErrorCode.QUEUE_FULL and "kept for others" in error.message
    assert error.retry_after_s is not None
    h.embed(polite, ["p"])
    assert polite.errors() == [] and len(h.pool.models["emb"].queue) == 7


async def test_more_connections_give_a_user_no_more_of_the_queue(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_queue=8)
    await one_busy_worker(h)
    connections = [h.sink(f"flood{i}") for i in range(4)]
    for i, sink in enumerate(connections):
        sink.owner = (1000, i)  # one user (uid 1000), four connections
    for i in range(8):
        h.embed(connections[i % 4], [f"f{i}"])
    refused = [e for sink in connections for e in sink.errors()]
    assert len(refused) == 2 and all("kept for others" in e.message for e in refused)
    polite = h.sink("polite")
    polite.owner = (1001, 9)
    h.embed(polite, ["p"])
    assert polite.errors() == [] and len(h.pool.models["emb"].queue) == 7


async def test_a_polite_client_is_served_between_a_floods_requests(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_batch=1)
    await one_busy_worker(h)
    (worker,) = h.workers("emb")
    flood, polite = h.sink("flood"), h.sink("polite")
    flood_ids = {h.embed(flood, [f"f{i}"]) for i in range(40)}
    polite_ids = {h.embed(polite, [f"p{i}"]) for i in range(4)}
    served = []
    for _ in range(8):
        job_id = h.job_ids(worker)[-1]
        h.reply_embeddings(worker, job_id, 1.0)
        h.want_work(worker)
        served.append(h.works(worker)[-1].items[0].request.id)
    assert sum(i in polite_ids for i in served) == 4  # every other dispatch
    assert sum(i in flood_ids for i in served) == 4
