"""How few statements the shared queue sends, on a real PostgreSQL: jobs written
together share one, a retrieve where the result was stored reads nothing back, a claim
that found nothing is not repeated until jobs may wait again, and statements run as
generic plans."""

from __future__ import annotations

import asyncio
import time

from cluster_helpers import Database
from pgjobs_helpers import done, node, record, submit

from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.pgjobs import PgJobs


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
