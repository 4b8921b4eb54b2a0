"""In-process nodes of the shared queue on a real PostgreSQL, for the tests of PgJobs:
a node (PgJobs connected and listening), job records, their endings, submitting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from cluster_helpers import Database

from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.pgjobs import PgJobs

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
