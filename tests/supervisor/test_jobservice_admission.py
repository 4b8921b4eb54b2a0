"""The job API on the pool with fakes, as jobs are admitted: the [jobs] bounds (and a
reload of them), refusals as a direct request's, and which jobs join one another."""

from __future__ import annotations

import pytest
from test_jobservice import ME, OTHER, MakeHarness, embed, service

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.fields import RequestDefaults
from modelpool.protocol.jobs import Submit
from modelpool.protocol.messages import Embed, Generate, Sampling
from modelpool.supervisor.admission import RemoteModel
from modelpool.supervisor.config import JobsConfig
from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.tasks import MemoryTaskQueue, QueueFull


async def test_a_reloaded_jobs_section_bounds_and_keeps_from_the_next_job_on(
        make_harness: MakeHarness) -> None:
    """[jobs] after a reload: the mailbox's and the queue's bounds, the retention of
    results (that of a job ended before too) and a job's default timeout."""
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    ended = await jobs.submit(ME, embed("a"), 100)
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
    await h.settle()
    held = (await jobs.stats()).mailbox_bytes
    jobs.follow_config(JobsConfig(result_retention_s=5, max_mailbox_bytes=held + 1,
                                  timeout_s=9))
    h.want_work(worker)
    await jobs.submit(ME, embed("b"), 100)  # there was room left
    assert h.works(worker)[-1].items[0].request.timeout_s == 9
    with pytest.raises(PoolError) as full:
        await jobs.submit(ME, embed("c"), 100)
    assert full.value.code is ErrorCode.OVERLOADED
    h.clock.advance(5)
    await jobs.tick()
    with pytest.raises(PoolError) as gone:
        await jobs.retrieve(ME, ended, 0, rid=1)
    assert gone.value.code is ErrorCode.RESULT_NOT_FOUND
    jobs.follow_config(JobsConfig(max_queued=1))
    await jobs.submit(ME, embed("d"), 100)  # the backlog of the worker's model
    with pytest.raises(PoolError) as queued:
        for i in range(20):
            await jobs.submit(ME, embed(f"e{i}"), 100)
    assert queued.value.code is ErrorCode.QUEUE_FULL and "max_queued" in queued.value.message


async def test_a_full_mailbox_refuses_new_jobs_and_keeps_what_it_has(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h, max_mailbox_bytes=50)
    key = await jobs.submit(ME, embed("x" * 60), 100)  # the first fits: room was left
    with pytest.raises(PoolError) as err:
        await jobs.submit(ME, embed("y"), 100)
    assert err.value.code is ErrorCode.OVERLOADED and err.value.retry_after_s
    assert (await jobs.info(ME, key)).state == "queued"


async def test_submit_refuses_what_a_direct_call_would(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h, max_queued=10)
    with pytest.raises(PoolError) as err:
        await jobs.submit(ME, Submit(id=1, request=Embed(id=1, model="nope", texts=["a"])), 1)
    assert err.value.code is ErrorCode.UNKNOWN_MODEL
    with pytest.raises(PoolError) as err:
        await jobs.submit(ME, Submit(id=1, request=Generate(id=1, model="gen")), 1)
    assert err.value.code is ErrorCode.BAD_REQUEST  # no prompt


async def test_a_job_for_another_nodes_model_joins_only_one_sent_alike(
        make_harness: MakeHarness) -> None:
    """Here a field left unset and the same field set to this daemon's default are one
    request; for a model only another node runs, whose generation config may fill in
    another value, they are not."""
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    jobs.elsewhere = lambda name: RemoteModel("far", "text_to_text") if name == "far" else None
    put: list[bytes | None] = []
    store = jobs.queue.put

    async def recording(record: JobRecord) -> None:
        put.append(record.dedup)
        await store(record)

    jobs.queue.put = recording  # type: ignore[method-assign]
    for model in ("gen", "far"):
        for sampling in (Sampling(seed=1), Sampling(seed=1),
                         Sampling(seed=1, temperature=RequestDefaults().temperature)):
            request = Generate(id=1, model=model, prompt="hi", sampling=sampling)
            await jobs.submit(ME, Submit(id=1, request=request), 100)
    here, far = put[:3], put[3:]
    assert None not in put
    assert here[0] == here[1] == here[2]
    assert far[0] == far[1] != far[2]



async def test_no_user_nor_tenant_takes_the_last_quarter_of_the_job_queue() -> None:
    """One user's (or one HTTP key's) flood of jobs leaves room for the others'."""
    queue = MemoryTaskQueue(max_queued=16)  # a user's share 12, a tenant's of it 9
    keys = iter(range(100))

    def job(uid: int, tenant: str = "") -> JobRecord:
        return JobRecord(key=f"j{next(keys)}", uid=uid, tenant=tenant, op="embed",
                         model="emb", priority="normal", request=b"", submitted_at=0.0)

    for _ in range(9):
        await queue.put(job(ME, "flooder"))
    with pytest.raises(QueueFull, match="tenant"):
        await queue.put(job(ME, "flooder"))
    for _ in range(3):
        await queue.put(job(ME, "polite"))
    with pytest.raises(QueueFull, match="user"):
        await queue.put(job(ME))
    await queue.put(job(OTHER, "flooder"))  # another user's tenant of that name
    assert len(await queue.claim({"emb": 13})) == 13
    for _ in range(9):  # each count went with the claims
        await queue.put(job(ME, "flooder"))


async def test_a_jobs_record_carries_its_requests_tenant(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    key = await jobs.submit(ME, embed("a", tenant="team-a"), 100)
    record = await jobs.mailbox.get(key)
    assert record is not None and record.tenant == "team-a"
