"""The shared queue and mailbox on a real PostgreSQL, driven in-process as two or more
daemons would: the schema, leases and their fencing, joins, cancels, bounds, and waiting
by LISTEN/NOTIFY (how few statements it takes: test_pgjobs_statements.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
from cluster_helpers import Database
from pgjobs_helpers import done, node, record, submit

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.pgjobs import PgJobs
from modelpool.supervisor.pgstore import MIGRATIONS, PgStore
from modelpool.supervisor.tasks import QueueFull


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


async def test_no_user_nor_tenant_takes_the_last_quarter_of_the_shared_queue(
        database: Database) -> None:
    """As in memory: one user's (or one HTTP key's) flood leaves room for the others',
    whichever node they submit through."""
    def job(uid: int, tenant: str = "") -> JobRecord:
        return msgspec.structs.replace(record(), uid=uid, tenant=tenant)

    async with node(database, "a", max_queued=16) as a, node(database, "b") as b:
        for _ in range(9):  # a user's share 12, a tenant's of it 9
            await submit(a, job(1000, "flooder"))
        with pytest.raises(QueueFull):
            await a.add(job(1000, "flooder"))
        for _ in range(3):
            await submit(a, job(1000, "polite"))
        with pytest.raises(QueueFull):
            await a.add(job(1000))
        await submit(a, job(2000, "flooder"))  # another user's tenant of that name
        assert await a.length() == 13
        assert len(await b.claim({"m": 13})) == 13
        for _ in range(9):  # what waits is counted, not what was claimed
            await submit(a, job(1000, "flooder"))


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


async def test_a_job_is_claimed_only_by_nodes_that_configure_its_model_alike(
        database: Database) -> None:
    async with node(database, "a") as a, node(database, "b") as b:
        a.variant, b.variant = {"m": "va"}.get, {"m": "vb"}.get
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
