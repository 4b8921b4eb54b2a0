"""The job API on the pool with fakes: submit, retrieve, cancel, forget, expiry, the job
queue, and a dead worker's job getting exactly one result (admission: its own file)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.jobs import Completion, Submit
from modelpool.protocol.messages import Embed, Embeddings, Generate, Sampling
from modelpool.protocol.pipes import Abort, WantWork
from modelpool.supervisor.config import JobsConfig
from modelpool.supervisor.jobservice import JobService, new_key
from modelpool.supervisor.mailbox import MemoryMailbox
from modelpool.supervisor.tasks import MemoryTaskQueue

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]
ME, OTHER = 1000, 1001


def service(h: Harness, **config: Any) -> JobService:
    jobs = JobsConfig(**config)
    mailbox = MemoryMailbox(h.clock, jobs.result_retention_s, jobs.max_mailbox_bytes)
    return JobService(h.pool, MemoryTaskQueue(jobs.max_queued), mailbox, jobs, "node-a")


def embed(*texts: str, single: bool = False, **fields: Any) -> Submit:
    return Submit(id=7, request=Embed(id=3, model="emb", texts=list(texts), **fields),
                  single=single)


async def test_submit_returns_a_key_and_retrieve_the_result(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    key = await jobs.submit(ME, embed("hello", single=True), 100)
    assert len(key) >= 22 and key != await jobs.submit(ME, embed("other"), 100)
    assert (await jobs.info(ME, key)).state == "queued"
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    assert (await jobs.info(ME, key)).state == "running"
    job_id = h.job_ids(worker)[0]
    h.reply_embeddings(worker, job_id, 0.5, 0.25)
    await h.settle()
    result = await jobs.retrieve(ME, key, 0, rid=42)
    assert (result.id, result.key, result.single) == (42, key, True)
    assert isinstance(result.result, Embeddings) and result.result.model == "emb"
    again = await jobs.retrieve(ME, key, 0, rid=43)  # any number of times
    assert again.result == result.result
    info = await jobs.info(ME, key)
    assert info.state == "done" and info.finished_at is not None and info.node == "node-a"


def test_keys_never_read_as_a_command_line_option() -> None:
    # One in 64 URL-safe base64 keys began with '-', which `modelpool result KEY` took
    # for an option; 2,000 keys of that kind would all but surely have shown one.
    keys = {new_key() for _ in range(2000)}
    assert len(keys) == 2000
    assert all(key[0].isalnum() and key.isalnum() and len(key) == 32 for key in keys)


async def test_retrieve_times_out_and_the_job_goes_on(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    key = await jobs.submit(ME, embed("slow"), 100)
    waiting = asyncio.ensure_future(jobs.retrieve(ME, key, 5.0, rid=1))
    await h.settle()
    h.clock.advance(5.0)
    with pytest.raises(PoolError) as err:
        await waiting
    assert err.value.code is ErrorCode.TIMEOUT and "goes on" in err.value.message
    waiting = asyncio.ensure_future(jobs.retrieve(ME, key, 60.0, rid=2))
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
    result = await waiting
    assert isinstance(result.result, Embeddings)


async def test_another_user_cannot_see_a_job(make_harness: MakeHarness) -> None:
    h = make_harness()
    jobs = service(h)
    key = await jobs.submit(ME, embed("mine"), 100)
    # A retrieve of another user's running job is refused at once, not after its wait.
    for call in (jobs.retrieve(OTHER, key, 30, rid=1), jobs.info(OTHER, key),
                 jobs.cancel(OTHER, key), jobs.forget(OTHER, key)):
        with pytest.raises(PoolError) as err:
            await asyncio.wait_for(call, 5)
        assert err.value.code is ErrorCode.RESULT_NOT_FOUND
    assert await jobs.recent(OTHER, 10) == []
    assert [j.key for j in await jobs.recent(ME, 10)] == [key]


async def test_a_generated_stream_is_kept_as_one_completion(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    request = Generate(id=1, model="gen", prompt="hi", sampling=Sampling(max_tokens=3))
    key = await jobs.submit(ME, Submit(id=1, request=request), 100)
    await h.settle()
    (worker,) = h.workers("gen")
    h.ready(worker)
    job_id = h.job_ids(worker)[0]
    for seq, text in enumerate(["Once", " upon", " a"]):
        h.chunk(worker, job_id, seq, text)
    h.end(worker, job_id, reason="length")
    await h.settle()
    result = (await jobs.retrieve(ME, key, 0, rid=1)).result
    assert isinstance(result, Completion)
    assert (result.text, result.finish_reason, result.completion_tokens) == (
        "Once upon a", "length", 3)


async def test_a_job_whose_worker_dies_gets_exactly_one_result(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=2)
    jobs = service(h)
    key = await jobs.submit(ME, embed("x"), 100)
    await h.settle()
    dying, other = h.workers("emb")
    h.ready(dying)
    h.die(dying, -9)
    h.ready(other)
    h.reply_embeddings(other, h.job_ids(other)[0], 1.0)
    h.reply_embeddings(other, h.job_ids(other)[0], 2.0)  # a duplicate reply: ignored
    await h.settle()
    assert isinstance((await jobs.retrieve(ME, key, 0, rid=1)).result, Embeddings)
    assert (await jobs.stats()).stored_results == 1


async def test_cancel_a_queued_and_a_running_job(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    request = Generate(id=1, model="gen", prompt="long", sampling=Sampling(temperature=1))
    running = await jobs.submit(ME, Submit(id=1, request=request), 100)
    queued = await jobs.submit(ME, Submit(id=2, request=request), 100)
    await h.settle()
    (worker,) = h.workers("gen")
    h.ready(worker)
    await jobs.cancel(ME, queued)
    await jobs.cancel(ME, running)
    await h.settle()
    assert any(isinstance(m, Abort) for m in h.sent(worker))  # the stream is stopped
    for key in (queued, running):
        with pytest.raises(PoolError) as err:
            await jobs.retrieve(ME, key, 0, rid=1)
        assert err.value.code is ErrorCode.CANCELLED
        assert (await jobs.info(ME, key)).state == "cancelled"


async def test_results_expire_after_the_retention_and_can_be_forgotten_early(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h, result_retention_s=60)
    kept = await jobs.submit(ME, embed("a"), 100)
    forgotten = await jobs.submit(ME, embed("b"), 100)
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    for job_id in h.job_ids(worker):  # one batch of both
        h.reply_embeddings(worker, job_id, 1.0)
    await h.settle()
    await jobs.forget(ME, forgotten)
    h.clock.advance(59)
    await jobs.tick()
    assert (await jobs.info(ME, kept)).state == "done"
    h.clock.advance(1)
    await jobs.tick()
    for key in (kept, forgotten):
        with pytest.raises(PoolError) as err:
            await jobs.retrieve(ME, key, 0, rid=1)
        assert err.value.code is ErrorCode.RESULT_NOT_FOUND
    assert (await jobs.stats()).mailbox_bytes == 0


async def test_jobs_wait_in_their_own_queue_in_priority_order(
        make_harness: MakeHarness) -> None:
    """The pool gets a backlog of jobs per worker; the rest wait in the job queue,
    bounded by max_queued (one user: three quarters of it), and leave it best first."""
    h = make_harness(cold_start_workers=1)
    jobs = service(h, max_queued=17)  # this user's share: 13
    keys = [await jobs.submit(ME, embed(f"t{i}", priority="batch"), 1) for i in range(10)]
    urgent = await jobs.submit(ME, embed("urgent", priority="high"), 1)
    assert len(h.pool.models["emb"].queue) == 8  # the backlog for one worker
    assert (await jobs.stats()).queued_jobs == 11
    for i in range(10):
        await jobs.submit(ME, embed(f"more {i}", priority="batch"), 1)
    with pytest.raises(PoolError) as err:
        await jobs.submit(ME, embed("too many"), 1)
    assert err.value.code is ErrorCode.QUEUE_FULL
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    for job_id in h.job_ids(worker):  # the first batch: the backlog
        h.reply_embeddings(worker, job_id, 1.0)
    await h.settle()
    assert (await jobs.info(ME, urgent)).state in ("queued", "running")
    h.want_work(worker)
    assert h.works(worker)[-1].items[0].request.texts == ["urgent"]  # claimed first
    assert (await jobs.info(ME, keys[0])).state == "done"


async def test_a_job_waiting_in_the_job_queue_ends_at_its_deadline_unstarted(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    for i in range(8):  # the backlog for one worker, in the pool: the next ones wait
        await jobs.submit(ME, embed(f"t{i}"), 1)
    late = await jobs.submit(ME, embed("late", deadline_s=5.0), 1)
    patient = await jobs.submit(ME, embed("patient", deadline_s=60.0), 1)
    waiting = asyncio.ensure_future(jobs.retrieve(ME, late, 30.0, rid=1))
    h.clock.advance(4.9)
    await jobs.tick()
    assert (await jobs.stats()).queued_jobs == 10
    h.clock.advance(0.2)
    await jobs.tick()
    with pytest.raises(PoolError) as err:
        await waiting
    assert err.value.code is ErrorCode.DEADLINE_EXPIRED
    assert "after 5.1s in the job queue" in err.value.message
    info = await jobs.info(ME, late)
    assert info.state == "failed" and info.started_at is None
    assert (await jobs.info(ME, patient)).state == "queued"
    assert (await jobs.stats()).queued_jobs == 9


async def test_a_streaming_model_takes_what_its_workers_can_start_and_one_more(
        make_harness: MakeHarness) -> None:
    """A stream holds its worker for its whole length: a deep backlog beside one worker
    would wait there while another daemon's worker idles."""
    h = make_harness(cold_start_workers=1)
    jobs = service(h)

    def generate(i: int) -> Submit:
        return Submit(id=i, request=Generate(id=i, model="gen", prompt=f"p{i}",
                                             sampling=Sampling(max_tokens=3)))

    for i in range(8):
        await jobs.submit(ME, generate(i), 1)
    gen = h.pool.models["gen"]
    assert len(gen.queue) == 2  # no worker yet: one to run and one beside it
    await h.settle()
    (worker,) = h.workers("gen")
    h.ready(worker, want_work=False, info={"max_active_sequences": 3})
    h.pool.handle(worker, WantWork(slots=3))  # it batches 3 streams
    await jobs.pump()  # as the next tick or ending does
    assert len(h.job_ids(worker)) == 3 and len(gen.queue) == 1  # 3 running, one beside
    assert (await jobs.stats()).queued_jobs == 5  # one beside it, four outside


async def test_jobs_the_pool_has_no_room_for_wait_instead_of_failing(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_queue=4)  # 3 per client: a quarter is kept
    jobs = service(h)
    keys = [await jobs.submit(ME, embed(f"t{i}"), 1) for i in range(6)]
    assert len(h.pool.models["emb"].queue) == 3
    assert [(await jobs.info(ME, k)).state for k in keys] == ["queued"] * 6
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    for _ in range(3):
        for job_id in h.job_ids(worker):
            h.reply_embeddings(worker, job_id, 1.0)
        await h.settle()
        h.want_work(worker)
    assert [(await jobs.info(ME, k)).state for k in keys] == ["done"] * 6
    assert (await jobs.stats()).failed == 0


class UnreachableClaims(MemoryTaskQueue):
    """A queue whose claims fail as a shared one's do while its server is away."""

    unreachable = False

    async def claim(self, rooms: Any) -> list[Any]:
        if self.unreachable:
            raise PoolError(ErrorCode.UNAVAILABLE, "the cluster's PostgreSQL is unreachable")
        return await super().claim(rooms)


async def test_a_stored_result_is_not_stored_again_when_the_next_claim_fails(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    config = JobsConfig()
    queue = UnreachableClaims(config.max_queued)
    mailbox = MemoryMailbox(h.clock, config.result_retention_s, config.max_mailbox_bytes)
    jobs = JobService(h.pool, queue, mailbox, config, "node-a")
    key = await jobs.submit(ME, embed("hello"), 100)
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    queue.unreachable = True  # the result is stored; the claim after it fails
    h.reply_embeddings(worker, h.job_ids(worker)[0], 0.5)
    await h.settle()
    queue.unreachable = False
    await jobs.tick()  # stores whatever waits to be stored: nothing should
    assert jobs.duplicates == 0
    assert isinstance((await jobs.retrieve(ME, key, 0, rid=1)).result, Embeddings)


class ClaimsAsTheDaemonStops(MemoryTaskQueue):
    """The daemon begins to stop while a claim is on its way (to PostgreSQL and back)."""

    pool: Any = None

    async def claim(self, rooms: Any) -> list[Any]:
        claimed = await super().claim(rooms)
        self.pool.shutting_down = True
        return claimed


async def test_a_job_claimed_as_the_daemon_stops_waits_again_for_another(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    config = JobsConfig()
    queue = ClaimsAsTheDaemonStops(config.max_queued)
    queue.pool = h.pool
    mailbox = MemoryMailbox(h.clock, config.result_retention_s, config.max_mailbox_bytes)
    jobs = JobService(h.pool, queue, mailbox, config, "node-a")
    key = await jobs.submit(ME, embed("hello"), 100)
    await h.settle()
    assert (await jobs.info(ME, key)).state == "queued"
    assert await queue.length() == 1  # back in the queue, not failed SHUTTING_DOWN
    assert (await jobs.stats()).failed == 0
