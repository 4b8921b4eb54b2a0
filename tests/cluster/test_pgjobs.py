"""The shared queue and mailbox on a real PostgreSQL, driven in-process as two or more
daemons would: the schema, leases and their fencing, joins, cancels, bounds, and waiting
by LISTEN/NOTIFY."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from cluster_helpers import Database

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.pgjobs import PgJobs
from modelpool.supervisor.pgstore import MIGRATIONS, PgStore
from modelpool.supervisor.tasks import QueueFull

KEYS = iter(range(10**6))


def record(model: str = "m", priority: str = "normal", dedup: bytes | None = None,
           at: float | None = None, deadline_in: float | None = None,
           variant: str | None = None) -> JobRecord:
    submitted = at if at is not None else time.time()
    return JobRecord(key=f"k{next(KEYS)}", uid=1000, op="embed", model=model,
                     priority=priority, request=b"\x80", dedup=dedup, submitted_at=submitted,
                     deadline_at=None if deadline_in is None else submitted + deadline_in,
                     variant=variant)


def done(rec: JobRecord, result: bytes) -> JobRecord:
    return JobRecord(key=rec.key, uid=rec.uid, op=rec.op, model=rec.model,
                     priority=rec.priority, request=b"", submitted_at=rec.submitted_at,
                     state="done", finished_at=time.time(), result=result)


@contextlib.asynccontextmanager
async def node(database: Database, name: str, lease_s: float = 10.0,
               max_queued: int = 10_000) -> AsyncIterator[PgJobs]:
    jobs = PgJobs(name, lease_s, retention_s=60, max_bytes=1 << 30, max_queued=max_queued)
    store = jobs.connect(database.dsn)
    await store.start()
    await asyncio.wait_for(store.listening.wait(), 10)
    try:
        yield jobs
    finally:
        await store.close()


async def submit(jobs: PgJobs, rec: JobRecord) -> JobRecord:
    await jobs.add(rec)
    await jobs.put(rec)
    return rec


async def test_the_schema_is_created_once_when_several_daemons_start_together(
        database: Database) -> None:
    stores = [PgStore(database.dsn, lambda c, p: None, lambda: None) for _ in range(4)]
    for store in stores:
        await store.pool.open(wait=False)
    try:
        versions = await asyncio.gather(*(store.migrate() for store in stores))
        again = await stores[0].migrate()
    finally:
        await asyncio.gather(*(store.pool.close() for store in stores))
    assert versions == [len(MIGRATIONS)] * 4 and again == len(MIGRATIONS)
    assert database.query("SELECT version FROM modelpool.meta") == [(len(MIGRATIONS),)]
    assert database.query("SELECT count(*) FROM modelpool.jobs") == [(0,)]


async def test_a_schema_a_newer_node_migrated_further_is_left_at_its_version(
        database: Database) -> None:
    store = PgStore(database.dsn, lambda c, p: None, lambda: None)
    await store.pool.open(wait=False)
    try:
        await store.migrate()
        database.query(f"UPDATE modelpool.meta SET version = {len(MIGRATIONS) + 1} "
                       "RETURNING version")
        assert await store.migrate() == len(MIGRATIONS) + 1
    finally:
        await store.pool.close()
    assert database.query("SELECT version FROM modelpool.meta") == [(len(MIGRATIONS) + 1,)]


async def test_a_claim_is_a_lease_and_only_its_holder_completes_the_job(
        database: Database) -> None:
    async with node(database, "a", lease_s=0.5) as a, node(database, "b", lease_s=0.5) as b:
        rec = await submit(a, record())
        assert [r.key for r in await a.claim({"m": 5})] == [rec.key]
        assert await b.claim({"m": 5}) == []  # held by a
        await asyncio.sleep(0.8)  # a neither renews nor finishes: its lease lapses
        assert await b.sweep() == 1
        again = await b.claim({"m": 5})
        assert [(r.key, r.attempt) for r in again] == [(rec.key, 2)]
        assert await a.extend([rec.key]) == [rec.key]  # a learns it lost the job
        assert not await a.finish(rec.key, done(rec, b"from a"))
        assert await b.finish(rec.key, done(rec, b"from b"))
        assert not await b.finish(rec.key, done(rec, b"twice"))
        stored = await a.get(rec.key)
    assert stored is not None and (stored.state, stored.result, stored.node) == \
        ("done", b"from b", "b")


async def test_a_lapsed_holder_that_comes_back_completes_nothing(database: Database) -> None:
    async with node(database, "a", lease_s=0.3) as a, node(database, "b") as b:
        rec = await submit(a, record())
        await a.claim({"m": 1})
        await asyncio.sleep(0.5)
        await b.sweep()  # requeued, not yet claimed again by anyone
        assert not await a.finish(rec.key, done(rec, b"late"))
        stored = await b.get(rec.key)
        assert stored is not None and stored.state == "queued" and stored.result is None


async def test_renewed_leases_are_not_swept(database: Database) -> None:
    async with node(database, "a", lease_s=0.4) as a, node(database, "b") as b:
        rec = await submit(a, record())
        await a.claim({"m": 1})
        for _ in range(4):
            await asyncio.sleep(0.2)
            assert await a.extend([rec.key]) == []
            assert await b.sweep() == 0
        assert await a.finish(rec.key, done(rec, b"ok"))


async def test_claims_take_priority_then_age_and_skip_what_others_hold(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        old = await submit(a, record(priority="low", at=1.0))
        normal = await submit(a, record(priority="normal", at=2.0))
        urgent = await submit(a, record(priority="critical", at=3.0))
        other = await submit(a, record(model="n"))
        first = await a.claim({"m": 2})
        second = await b.claim({"m": 2})
        assert [r.key for r in first] == [urgent.key, normal.key]
        assert [r.key for r in second] == [old.key]
        assert await a.waiting() == {("n", None): 1} and other.state == "queued"
        third = await submit(a, record(model="n"))
        both = await a.claim({"m": 5, "n": 5})  # every model in one statement
        assert {r.key for r in both} == {other.key, third.key}


async def test_identical_work_joins_the_running_job_and_gets_its_result(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        leader = await submit(a, record(dedup=b"same"))
        joiner = await submit(b, record(dedup=b"same"))
        assert [r.key for r in await a.claim({"m": 5})] == [leader.key]
        assert await b.claim({"m": 5}) == []  # the joiner waits on the leader, unclaimed
        waiting = asyncio.create_task(b.wait(joiner.key, 10, 1000))
        await asyncio.sleep(0.1)
        assert await a.finish(leader.key, done(leader, b"shared"))
        ended = await asyncio.wait_for(waiting, 5)
    assert ended is not None and (ended.state, ended.result) == ("done", b"shared")


async def test_a_cancelled_leaders_joiners_run_on_their_own(database: Database) -> None:
    async with node(database, "a") as a:
        leader = await submit(a, record(dedup=b"same"))
        joiner = await submit(a, record(dedup=b"same"))
        await a.claim({"m": 5})
        cancelled = JobRecord(key=leader.key, uid=1000, op="embed", model="m",
                              priority="normal", request=b"", submitted_at=0.0,
                              state="cancelled", finished_at=time.time(),
                              error_code="CANCELLED", error_message="cancelled")
        assert await a.finish(leader.key, cancelled)
        assert [r.key for r in await a.claim({"m": 5})] == [joiner.key]


async def test_a_cancelled_waiting_leaders_joiners_run_on_their_own(
        database: Database) -> None:
    async with node(database, "a") as a:
        leader = await submit(a, record(dedup=b"same"))
        joiner = await submit(a, record(dedup=b"same"))
        assert await a.cancel(leader.key)  # cancelled before any node claimed it
        assert [r.key for r in await a.claim({"m": 5})] == [joiner.key]
        cancelled = await a.get(leader.key)
    assert cancelled is not None and cancelled.state == "cancelled"


async def test_a_waiting_job_ends_at_its_deadline_and_its_joiners_run_on_their_own(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        late = await submit(a, record(deadline_in=0.3, dedup=b"same"))
        joiner = await submit(a, record(dedup=b"same"))  # no deadline of its own
        later = await submit(a, record(model="n", deadline_in=60))
        waiting = asyncio.create_task(b.wait(late.key, 10, 1000))
        assert await b.expire_waiting(time.time()) == []  # not yet
        await asyncio.sleep(0.5)
        assert await b.expire_waiting(time.time()) == []  # stored by the statement itself
        ended = await asyncio.wait_for(waiting, 5)
        assert [r.key for r in await a.claim({"m": 5, "n": 5})] == [joiner.key, later.key]
    assert ended is not None and (ended.state, ended.error_code) == (
        "failed", "DEADLINE_EXPIRED")
    assert "deadline passed while it waited" in (ended.error_message or "")


async def test_the_waiting_jobs_of_a_stranded_model_end_and_no_other(
        database: Database) -> None:
    async with node(database, "a") as a:
        running = await submit(a, record())
        await a.claim({"m": 1})
        waiting = [await submit(a, record()) for _ in range(3)]
        other = await submit(a, record(model="n"))
        assert await a.end_stranded("m", None, ": no node") == 3
        ended = [await a.get(r.key) for r in waiting]
        assert {(r.state, r.error_code) for r in ended if r} == {
            ("failed", "MODEL_LOAD_FAILED")}
        assert (await a.waiting()) == {("n", None): 1} and other.state == "queued"
        still = await a.get(running.key)
    assert still is not None and still.state == "running"


async def test_a_cancel_ends_a_waiting_job_and_wakes_its_retrieve_on_another_node(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        rec = await submit(a, record())
        waiting = asyncio.create_task(b.wait(rec.key, 10, 1000))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        assert await a.cancel(rec.key)
        ended = await asyncio.wait_for(waiting, 5)
        woke_s = time.monotonic() - started
    assert ended is not None and (ended.state, ended.error_code) == ("cancelled", "CANCELLED")
    assert woke_s < 2.0  # by notification, not at the 10 s timeout


async def test_a_cancel_of_a_running_job_reaches_the_node_running_it(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        heard: list[str] = []
        b.on_cancel = heard.append
        rec = await submit(a, record())
        await b.claim({"m": 1})
        assert not await a.cancel(rec.key)  # running: its holder must stop it
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.02)
    assert heard == [rec.key]


async def test_a_wake_up_that_is_no_ending_does_not_end_a_retrieve(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        rec = await submit(a, record())
        (claimed,) = await b.claim({"m": 5})
        waiting = asyncio.create_task(a.wait(rec.key, 10, 1000))
        await asyncio.sleep(0.2)
        a.reconnected()  # as after a lost connection: every waiter looks again
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the job still runs: the retrieve keeps waiting
        assert await b.finish(claimed.key, done(claimed, b"ok"))
        ended = await asyncio.wait_for(waiting, 5)
        assert ended is not None and (ended.state, ended.result) == ("done", b"ok")


async def test_new_jobs_wake_other_nodes(database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        b.ready.clear()
        await submit(a, record())
        await asyncio.wait_for(b.ready.wait(), 5)


async def test_a_node_free_to_run_a_job_claims_it_as_it_writes_it(database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        b.ready.clear()
        mine = record()
        await a.add(mine, claim=True)
        assert (mine.state, mine.attempt) == ("running", 1)
        await asyncio.sleep(0.3)
        assert not b.ready.is_set()  # nobody else was woken for it
        assert await b.claim({"m": 5}) == []
        assert await a.finish(mine.key, done(mine, b"ok"))  # a holds it: its result counts
        # Something of the model waits at its priority or above: it queues behind that.
        waiting = await submit(b, record(priority="high"))
        later = record(priority="normal")
        await a.add(later, claim=True)
        assert later.state == "queued"
        assert [r.key for r in await b.claim({"m": 5})] == [waiting.key, later.key]


async def test_the_shared_queue_has_a_bound(database: Database) -> None:
    async with node(database, "a", max_queued=3) as a:
        for _ in range(3):
            await submit(a, record())
        with pytest.raises(QueueFull):
            await a.add(record())
        assert await a.length() == 3


async def test_an_unreachable_server_is_a_clear_error() -> None:
    jobs = PgJobs("a", 10, 60, 1 << 30, 100)
    store = jobs.connect("postgresql://nobody@127.0.0.1:1/none")
    await store.pool.open(wait=False)
    try:
        with pytest.raises(PoolError) as raised:
            await store.migrate()
    finally:
        await store.close()
    assert raised.value.code is ErrorCode.UNAVAILABLE
    assert "unreachable" in raised.value.message


async def test_nodes_claiming_at_once_never_claim_the_same_job(database: Database) -> None:
    async with contextlib.AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(node(database, name)) for name in "abcd"]
        keys = {(await submit(nodes[0], record())).key for _ in range(300)}

        async def claim_all(jobs: PgJobs) -> list[str]:
            claimed: list[str] = []
            while batch := await jobs.claim({"m": 3}):
                claimed += [r.key for r in batch]
            return claimed

        claims = await asyncio.gather(*(claim_all(jobs) for jobs in nodes))
    every = [key for claimed in claims for key in claimed]
    assert sorted(every) == sorted(keys)  # each exactly once
    assert sum(bool(claimed) for claimed in claims) >= 2  # they did claim side by side


def count_statements(jobs: PgJobs) -> list[str]:
    """Every statement the node sends from now on."""
    sent: list[str] = []
    fetch = jobs._fetch

    async def counted(sql: str, params: object = ()) -> list[dict[str, object]]:
        sent.append(" ".join(sql.split()))
        return await fetch(sql, params)

    jobs._fetch = counted  # type: ignore[method-assign]
    return sent


async def test_jobs_written_together_share_statements_and_identical_ones_join_the_first(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        await a.usage()  # the mailbox's size is counted: not among the statements below
        sent = count_statements(a)
        plain = [record() for _ in range(30)]
        same = [record(dedup=b"same") for _ in range(10)]
        await asyncio.gather(*(a.add(r) for r in [*plain, *same]))
        inserts = [s for s in sent if "INSERT INTO" in s]
        assert 1 <= len(inserts) <= 2  # the first alone, the rest in the next
        assert {r.state for r in plain} == {"queued"}
        assert [r.state for r in same].count("queued") == 1  # one leader, nine joined it
        claimed = await b.claim({"m": 100})
        assert len(claimed) == 31
        leader = next(r for r in claimed if r.key in {s.key for s in same})
        waits = [asyncio.create_task(a.wait(r.key, 10, 1000)) for r in same]
        results = [done(r, b"r" + r.key.encode()) for r in claimed]
        stored = await asyncio.gather(*(b.finish(r.key, res)
                                        for r, res in zip(claimed, results, strict=True)))
        assert all(stored)
        ended = await asyncio.wait_for(asyncio.gather(*waits), 5)
    assert {(e.state, e.result) for e in ended if e is not None} == \
        {("done", b"r" + leader.key.encode())}
    assert len(ended) == 10


async def test_a_retrieve_on_the_node_that_stored_the_result_does_not_read_it_back(
        database: Database) -> None:
    async with node(database, "a") as a:
        rec = await submit(a, record())
        [claimed] = await a.claim({"m": 1})
        sent = count_statements(a)
        waiting = asyncio.create_task(a.wait(rec.key, 10, 1000))
        await asyncio.sleep(0.1)  # it has read the job once: running
        assert await a.finish(rec.key, done(claimed, b"here"))
        ended = await asyncio.wait_for(waiting, 5)
    assert ended is not None and (ended.state, ended.result, ended.node) == \
        ("done", b"here", "a")
    assert len(sent) == 2, sent  # the read, then the UPDATE
    assert "WHERE key = ANY" in sent[0] and "UPDATE" in sent[1]


async def test_a_claim_that_found_nothing_is_not_repeated_until_jobs_may_wait_again(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        assert await a.claim({"m": 4}) == []
        sent = count_statements(a)
        assert await a.claim({"m": 4}) == []
        assert sent == []  # nothing new was announced: no statement
        rec = await submit(b, record())  # its notification reaches a
        deadline = time.monotonic() + 5
        claimed: list[JobRecord] = []
        while not claimed and time.monotonic() < deadline:
            claimed = await a.claim({"m": 4})
            await asyncio.sleep(0.01)
        assert [r.key for r in claimed] == [rec.key]
        assert await a.claim({"m": 4}) == []
        before = len(sent)
        await a.sweep()  # each tick looks again, notification or not
        assert await a.claim({"m": 4}) == [] and len(sent) == before + 2


async def test_the_statements_run_as_generic_plans(database: Database) -> None:
    async with node(database, "a") as a:
        assert a.store is not None
        rows = await a.store.fetch("SHOW plan_cache_mode")
    assert rows == [{"plan_cache_mode": "force_generic_plan"}]  # planned once, not per call


async def test_a_job_is_claimed_only_by_nodes_that_configure_its_model_alike(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        a.variants, b.variants = {"m": "va"}, {"m": "vb"}
        theirs = await submit(a, record(variant="vb", priority="critical"))
        ours = await submit(a, record(variant="va"))
        older = await submit(a, record())  # of a node that does not say: anyone's
        assert await a.waiting() == {("m", "vb"): 1, ("m", "va"): 1, ("m", None): 1}
        assert [r.key for r in await a.claim({"m": 5})] == [ours.key, older.key]
        assert [r.key for r in await b.claim({"m": 5})] == [theirs.key]
        # b's waiting job of higher priority does not stop a from claiming at once.
        await submit(a, record(variant="vb", priority="critical"))
        mine = record(variant="va")
        await a.add(mine, claim=True)
        assert mine.state == "running"
        # Each variant's stranded jobs end apart.
        assert await a.end_stranded("m", "vb", ": no node like b") == 1
        assert await a.waiting() == {}
