"""The shared job queue and mailbox on PostgreSQL: both interfaces over one table, so a
job's row is at once its place in the queue, its claim and its record and result.

- Claims are leases (FOR UPDATE SKIP LOCKED; lease_until in the server's clock, renewed
  while the job runs here); a lapsed lease goes back to the queue at the next sweep, so
  another daemon runs the job (at least once).
- Completion is fenced by (node, attempt): a daemon completes only the jobs it still
  holds, so the first completion wins and a daemon that comes back after being presumed
  dead completes nothing it lost.
- Identical work joins the job already waiting or running (its `leader`) and gets its
  result; a cancelled leader's joiners run on their own.
- Waiting is by LISTEN/NOTIFY: new jobs wake claimers, ended jobs wake retrieves,
  cancels reach the daemon running the job.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.protocol.jobs import ENDED
from modelpool.protocol.messages import PRIORITIES
from modelpool.supervisor.mailbox import JobRecord, MailboxFull
from modelpool.supervisor.pgstore import PgStore
from modelpool.supervisor.queueing import PRIORITY_RANK
from modelpool.supervisor.tasks import QueueFull

T = "modelpool.jobs"
COLUMNS = ("key, uid, op, model, priority, request, single, submitted_at, state, started_at, "
           "finished_at, node, result, error_code, error_message, attempt")
USAGE_TTL_S = 1.0  # the mailbox's size is counted at most this often


class PgJobs:
    def __init__(self, node: str, lease_s: float, retention_s: float, max_bytes: int,
                 max_queued: int) -> None:
        self.node = node
        self.lease_s = lease_s
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.max_queued = max_queued
        self.store: PgStore | None = None  # set by connect()
        self.ready = asyncio.Event()
        self.on_cancel: Callable[[str], None] | None = None
        self._held: dict[str, int] = {}  # jobs this daemon holds: key -> attempt
        self._waiters: dict[str, list[asyncio.Future[None]]] = collections.defaultdict(list)
        self._usage = (0, 0, -USAGE_TTL_S)  # (records, bytes, when counted)

    def connect(self, dsn: str) -> PgStore:
        self.store = PgStore(dsn, self.notified, self.reconnected)
        return self.store

    async def _fetch(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        assert self.store is not None
        return await self.store.fetch(sql, params)

    # ---- notifications ------------------------------------------------------------------

    def notified(self, channel: str, key: str) -> None:
        if channel == "modelpool_jobs":
            self.ready.set()
        elif channel == "modelpool_done":
            self._wake(key)
        elif channel == "modelpool_cancel" and key in self._held and self.on_cancel:
            self.on_cancel(key)

    def reconnected(self) -> None:
        self.ready.set()  # jobs may have come while we were not listening
        for key in list(self._waiters):
            self._wake(key)

    def _wake(self, key: str) -> None:
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)

    # ---- the mailbox ----------------------------------------------------------------------

    async def add(self, record: JobRecord, claim: bool = False) -> None:
        """Claimed at once (claim, and nothing of its model waits at its priority or
        above: priorities hold across nodes), it wakes no other node; queued, it wakes
        them all."""
        _, nbytes, _ = await self._counted()
        if nbytes >= self.max_bytes:
            raise MailboxFull(f"the cluster's mailbox holds {nbytes >> 20} MiB "
                              f"(max_mailbox_bytes {self.max_bytes >> 20} MiB)")
        rows = await self._fetch(f"""
            WITH leader AS (
                SELECT key FROM {T} WHERE %(dedup)s::bytea IS NOT NULL AND dedup = %(dedup)s
                    AND state IN ('queued', 'running') AND leader IS NULL LIMIT 1),
            waiting AS (SELECT count(*) AS n FROM {T} WHERE state = 'queued'),
            fate AS (SELECT CASE
                WHEN EXISTS (SELECT 1 FROM leader) THEN 'joined'
                WHEN %(claim)s AND NOT EXISTS (
                    SELECT 1 FROM {T} WHERE state = 'queued' AND model = %(model)s
                        AND priority <= %(priority)s) THEN 'running'
                ELSE 'queued' END AS state),
            added AS (
                INSERT INTO {T} (key, uid, op, model, priority, request, single, dedup,
                                 leader, submitted_at, state, node, attempt, lease_until,
                                 started_at)
                SELECT %(key)s, %(uid)s, %(op)s, %(model)s, %(priority)s, %(request)s,
                       %(single)s, %(dedup)s, (SELECT key FROM leader), %(submitted_at)s,
                       fate.state, CASE WHEN fate.state = 'running' THEN %(node)s ELSE '' END,
                       CASE WHEN fate.state = 'running' THEN 1 ELSE 0 END,
                       CASE WHEN fate.state = 'running'
                            THEN now() + make_interval(secs => %(lease)s) END,
                       CASE WHEN fate.state = 'running' THEN %(submitted_at)s END
                FROM fate WHERE (SELECT n FROM waiting) < %(max_queued)s
                RETURNING state, model)
            SELECT state, CASE WHEN state <> 'running'
                               THEN pg_notify('modelpool_jobs', model)::text END FROM added""",
            {**_params(record), "max_queued": self.max_queued, "claim": claim,
             "node": self.node, "lease": self.lease_s})
        if not rows:
            raise QueueFull(f"{self.max_queued} jobs wait in the cluster ([jobs] max_queued)")
        record.state = rows[0]["state"]
        if record.state == "running":
            record.attempt = 1
            self._held[record.key] = 1

    async def start(self, key: str, node: str, at: float) -> None:
        return None  # the claim marked it running

    async def finish(self, key: str, outcome: JobRecord) -> bool:
        attempt = self._held.get(key)
        if attempt is None:
            return False  # not ours (any more)
        rows = await self._fetch(f"""
            WITH done AS (
                UPDATE {T} SET state = %(state)s, result = %(result)s,
                    error_code = %(code)s, error_message = %(message)s,
                    finished_at = %(at)s, lease_until = NULL,
                    expires_at = now() + make_interval(secs => %(keep)s)
                WHERE key = %(key)s AND state = 'running' AND node = %(node)s
                    AND attempt = %(attempt)s
                RETURNING key),
            joiners AS (
                UPDATE {T} SET state = CASE WHEN %(state)s = 'cancelled' THEN 'queued'
                                            ELSE %(state)s END,
                    leader = CASE WHEN %(state)s = 'cancelled' THEN NULL ELSE leader END,
                    result = %(result)s, error_code = %(code)s, error_message = %(message)s,
                    finished_at = CASE WHEN %(state)s = 'cancelled' THEN NULL
                                       ELSE %(at)s END,
                    expires_at = CASE WHEN %(state)s = 'cancelled' THEN NULL
                                      ELSE now() + make_interval(secs => %(keep)s) END
                WHERE leader = %(key)s AND state = 'joined' AND EXISTS (SELECT 1 FROM done)
                RETURNING key, state)
            SELECT pg_notify(CASE WHEN state = 'queued' THEN 'modelpool_jobs'
                                  ELSE 'modelpool_done' END, key), key
                FROM (SELECT key, 'ended' AS state FROM done
                      UNION ALL SELECT key, state FROM joiners) AS ended""",
            {"state": outcome.state, "result": outcome.result, "code": outcome.error_code,
             "message": outcome.error_message, "at": outcome.finished_at, "key": key,
             "node": self.node, "attempt": attempt, "keep": self.retention_s})
        self._held.pop(key, None)  # kept until then: a failed query is tried again
        return any(row["key"] == key for row in rows)

    async def wait(self, key: str, timeout_s: float, uid: int) -> JobRecord | None:
        """Looks again at every wake-up until the job has ended or the time is up: a
        wake-up is a hint, not an ending (a reconnection wakes every waiter)."""
        deadline = time.monotonic() + timeout_s
        while True:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[key].append(waiter)  # before looking: no ending can slip between
            try:
                record = await self.get(key)
                if record is None or record.uid != uid:
                    return None
                left = deadline - time.monotonic()
                if record.state in ENDED or left <= 0:
                    return record
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter, left)
            finally:
                waiting = self._waiters.get(key)
                if waiting and waiter in waiting:
                    waiting.remove(waiter)
                    if not waiting:
                        del self._waiters[key]

    async def get(self, key: str) -> JobRecord | None:
        rows = await self._fetch(f"SELECT {COLUMNS} FROM {T} WHERE key = %s", (key,))
        return _record(rows[0]) if rows else None

    async def remove(self, key: str) -> bool:
        return bool(await self._fetch(f"DELETE FROM {T} WHERE key = %s RETURNING key", (key,)))

    async def recent(self, uid: int, limit: int) -> list[JobRecord]:
        rows = await self._fetch(f"SELECT {COLUMNS} FROM {T} WHERE uid = %s "
                                 "ORDER BY submitted_at DESC LIMIT %s", (uid, limit))
        return [_record(row) for row in rows]

    async def expire(self, now: float) -> int:
        rows = await self._fetch(f"DELETE FROM {T} WHERE expires_at < now() RETURNING key")
        return len(rows)

    async def usage(self) -> tuple[int, int]:
        records, nbytes, _ = await self._counted(fresh=True)
        return records, nbytes

    async def _counted(self, fresh: bool = False) -> tuple[int, int, float]:
        if fresh or time.monotonic() - self._usage[2] > USAGE_TTL_S:
            rows = await self._fetch(f"""SELECT count(*) AS n, coalesce(sum(
                octet_length(request) + coalesce(octet_length(result), 0)), 0) AS bytes
                FROM {T}""")
            self._usage = (rows[0]["n"], int(rows[0]["bytes"]), time.monotonic())
        return self._usage

    # ---- the queue --------------------------------------------------------------------

    async def put(self, record: JobRecord) -> None:
        return None  # add() queued it and woke the claimers

    async def waiting(self) -> dict[str, int]:
        rows = await self._fetch(f"SELECT model, count(*) AS n FROM {T} WHERE state = 'queued' "
                                 "GROUP BY model")
        return {row["model"]: row["n"] for row in rows}

    async def claim(self, rooms: Mapping[str, int]) -> list[JobRecord]:
        if not rooms:
            return []
        rows = await self._fetch(f"""
            UPDATE {T} SET state = 'running', node = %(node)s, attempt = attempt + 1,
                lease_until = now() + make_interval(secs => %(lease)s),
                started_at = coalesce(started_at, %(now)s)
            WHERE key IN (
                SELECT picked.key
                FROM unnest(%(models)s::text[], %(limits)s::int[]) AS room(model, n)
                CROSS JOIN LATERAL (
                    SELECT key FROM {T} WHERE state = 'queued' AND model = room.model
                    ORDER BY priority, submitted_at LIMIT room.n
                    FOR UPDATE SKIP LOCKED) AS picked)
            RETURNING {COLUMNS}""",
            {"node": self.node, "lease": self.lease_s, "models": list(rooms),
             "limits": list(rooms.values()), "now": time.time()})
        records = sorted((_record(row) for row in rows),
                         key=lambda r: (PRIORITY_RANK[r.priority], r.submitted_at))
        for record in records:
            self._held[record.key] = record.attempt
        return records

    async def complete(self, key: str) -> bool:
        return True  # finish() is where the claim's holder is checked

    async def release(self, record: JobRecord) -> None:
        attempt = self._held.pop(record.key, None)
        await self._fetch(f"""
            UPDATE {T} SET state = 'queued', node = '', lease_until = NULL
            WHERE key = %s AND node = %s AND attempt = %s AND state = 'running'
            RETURNING pg_notify('modelpool_jobs', model)""",
            (record.key, self.node, attempt))

    async def extend(self, keys: list[str]) -> list[str]:
        rows = await self._fetch(f"""
            UPDATE {T} SET lease_until = now() + make_interval(secs => %s)
            WHERE key = ANY(%s) AND node = %s AND state = 'running'
            RETURNING key, attempt""", (self.lease_s, keys, self.node))
        kept = {row["key"] for row in rows if self._held.get(row["key"]) == row["attempt"]}
        lost = [key for key in keys if key not in kept]
        for key in lost:
            self._held.pop(key, None)
        return lost

    async def cancel(self, key: str) -> bool:
        rows = await self._fetch(f"""
            UPDATE {T} SET state = 'cancelled', error_code = 'CANCELLED',
                error_message = 'job ' || key || ' cancelled', finished_at = %s,
                expires_at = now() + make_interval(secs => %s)
            WHERE key = %s AND state IN ('queued', 'joined')
            RETURNING pg_notify('modelpool_done', key)""", (time.time(), self.retention_s, key))
        if not rows:  # running somewhere: whoever runs it stops it
            await self._fetch("SELECT pg_notify('modelpool_cancel', %s)", (key,))
        return bool(rows)

    async def sweep(self) -> int:
        rows = await self._fetch(f"""
            UPDATE {T} SET state = 'queued', node = '', lease_until = NULL
            WHERE state = 'running' AND lease_until < now()
            RETURNING pg_notify('modelpool_jobs', model)""")
        return len(rows)

    async def length(self) -> int:
        rows = await self._fetch(f"SELECT count(*) AS n FROM {T} WHERE state = 'queued'")
        return int(rows[0]["n"])


def _params(record: JobRecord) -> dict[str, Any]:
    return {"key": record.key, "uid": record.uid, "op": record.op, "model": record.model,
            "priority": PRIORITY_RANK[record.priority],  # type: ignore[index]
            "request": record.request, "single": record.single, "dedup": record.dedup,
            "submitted_at": record.submitted_at}


def _record(row: dict[str, Any]) -> JobRecord:
    state = row["state"]
    return JobRecord(
        key=row["key"], uid=row["uid"], op=row["op"], model=row["model"],
        priority=PRIORITIES[row["priority"]], request=bytes(row["request"]),
        single=row["single"], submitted_at=row["submitted_at"],
        state="queued" if state == "joined" else state, started_at=row["started_at"],
        finished_at=row["finished_at"], node=row["node"],
        result=bytes(row["result"]) if row["result"] is not None else None,
        error_code=row["error_code"], error_message=row["error_message"],
        attempt=row["attempt"])
