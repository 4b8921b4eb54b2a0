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

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.fields import PRIORITIES
from modelpool.protocol.jobs import ENDED
from modelpool.supervisor import pgbatches
from modelpool.supervisor.groupcommit import GroupCommit
from modelpool.supervisor.mailbox import JobRecord, MailboxFull
from modelpool.supervisor.owners import share_of
from modelpool.supervisor.pgstore import CHANNELS, PgStore
from modelpool.supervisor.pgstreams import (
    RelayedStreams,
    StreamFollowers,
    StreamPublisher,
    stream_channel,
)
from modelpool.supervisor.queueing import PRIORITY_RANK
from modelpool.supervisor.tasks import QueueFull

T = pgbatches.T
COLUMNS = pgbatches.COLUMNS
USAGE_TTL_S = 1.0  # the mailbox's size is counted at most this often

# Waiting jobs that end without running (a cancel, a passed deadline, a model no node
# can run): the jobs that joined one of them go back to the queue, to run on their own,
# rather than wait on a leader that never runs.
END_WAITING = """
    WITH ended AS (
        UPDATE {T} SET state = %(state)s, error_code = %(code)s,
            error_message = 'job ' || key || %(why)s, finished_at = %(now)s,
            expires_at = now() + make_interval(secs => %(keep)s)
        WHERE state IN ('queued', 'joined') AND {where}
        RETURNING key),
    freed AS (
        UPDATE {T} SET state = 'queued', leader = NULL
        WHERE state = 'joined' AND leader IN (SELECT key FROM ended)
            AND key NOT IN (SELECT key FROM ended)
        RETURNING model)
    SELECT key, pg_notify(CASE WHEN key IS NULL THEN 'modelpool_jobs'
                               ELSE 'modelpool_done' END, coalesce(key, model))
    FROM (SELECT key, NULL AS model FROM ended
          UNION ALL SELECT NULL, model FROM freed) AS touched"""


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
        # Retrieves waiting here: woken with the record when this node stored it, with
        # None by a notification (then they read it).
        self._waiters: dict[str, list[asyncio.Future[JobRecord | None]]] = \
            collections.defaultdict(list)
        # Group commits of the statements every job runs through (pgbatches).
        self._insert = GroupCommit(self._insert_many)
        self._finish = GroupCommit(self._finish_many)
        self._read = GroupCommit(self._read_many)
        self._usage = (0, 0, -USAGE_TTL_S)  # (records, bytes, when counted)
        # Claims skip a model whose queue a claim found empty, until a hint that jobs may
        # wait again (a notification of new jobs, a reconnection, a sweep at each tick):
        # every ending asks for a claim, and most would find nothing.
        self._hints = 0
        self._storing: dict[str, bool] = {}  # results being stored -> ended meanwhile?
        self._drained: dict[str, int] = {}  # model -> _hints when found empty
        # The variant of each model as this node configures it (set by the cluster): it
        # claims only jobs of that variant (or of none).
        self.variant: Callable[[str], str | None] = lambda model: None
        # Relayed streams: this node's clients' pieces arrive on its channel; pieces of
        # the streams it runs for other nodes' clients leave through the publisher.
        self.streams = RelayedStreams(stream_channel(node), StreamFollowers(),
                                      StreamPublisher(self._fetch))

    def connect(self, dsn: str) -> PgStore:
        self.store = PgStore(dsn, self.notified, self.reconnected,
                             (*CHANNELS, self.streams.channel))
        return self.store

    async def _fetch(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        assert self.store is not None
        return await self.store.fetch(sql, params)

    # ---- notifications ------------------------------------------------------------------

    def notified(self, channel: str, key: str) -> None:
        """`key`: the payload (a job's key, a model; on the streams' channel a piece)."""
        if channel == "modelpool_jobs":
            self._hints += 1
            self.ready.set()
        elif channel == "modelpool_done":
            if key in self._storing:
                self._storing[key] = True
            else:
                self._wake(key)
        elif channel == "modelpool_cancel" and key in self._held and self.on_cancel:
            self.on_cancel(key)
        elif channel == self.streams.channel:
            self.streams.followers.notified(key)

    def reconnected(self) -> None:
        self._hints += 1
        self.ready.set()  # jobs may have come while we were not listening
        for key in list(self._waiters):
            self._wake(key)

    def _wake(self, key: str, record: JobRecord | None = None) -> None:
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(record)

    # ---- the mailbox ----------------------------------------------------------------------

    async def add(self, record: JobRecord, claim: bool = False) -> None:
        """Claimed at once (claim, and nothing of its model waits at its priority or
        above: priorities hold across nodes), it wakes no other node; queued, it wakes
        them all."""
        record.state = await self._insert((record, claim))  # QueueFull, MailboxFull
        if record.state == "running":
            record.attempt = 1
            self._held[record.key] = 1

    async def _insert_many(self, records: list[tuple[JobRecord, bool]]) -> list[str | Exception]:
        _, nbytes, _ = await self._counted()
        if nbytes >= self.max_bytes:
            full = MailboxFull(f"the cluster's mailbox holds {nbytes >> 20} MiB "
                               f"(max_mailbox_bytes {self.max_bytes >> 20} MiB)")
            return [full] * len(records)
        rows = await self._fetch(pgbatches.INSERT, {
            **pgbatches.insert_params(records), "max_queued": self.max_queued,
            "user_share": share_of(self.max_queued),
            "tenant_share": share_of(share_of(self.max_queued)),
            "node": self.node, "lease": self.lease_s})
        states = {row["key"]: row["state"] for row in rows}
        full = QueueFull(f"{self.max_queued} jobs wait in the cluster ([jobs] max_queued), "
                         "or this user's or tenant's share of them (three quarters)")
        return [states.get(record.key, full) for record, _ in records]

    async def start(self, key: str, node: str, at: float) -> None:
        return None  # the claim marked it running

    async def finish(self, key: str, outcome: JobRecord) -> bool:
        attempt = self._held.get(key)
        if attempt is None:
            return False  # not ours (any more)
        # Its own notification may come back before the statement's answer: the wake-up
        # it would give waits for that answer, which says whether it was ours.
        self._storing[key] = False
        stored = False
        try:
            stored = await self._finish((outcome, attempt))
        finally:
            noted = self._storing.pop(key, False)
            if stored:
                self._wake(key, outcome)  # a retrieve here needs not read it back
            elif noted:
                self._wake(key)
        self._held.pop(key, None)  # kept until then: a failed query is tried again
        return stored

    async def _finish_many(self, outcomes: list[tuple[JobRecord, int]]) -> list[bool]:
        rows = await self._fetch(pgbatches.FINISH, {
            **pgbatches.finish_params(outcomes), "node": self.node, "keep": self.retention_s})
        stored = {row["key"] for row in rows if row["leads"]}
        seen: set[str] = set()  # the same job twice in one batch: the first one counts
        out = []
        for outcome, _ in outcomes:
            out.append(outcome.key in stored and outcome.key not in seen)
            seen.add(outcome.key)
        return out

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
                    ended = await asyncio.wait_for(waiter, left)
                    if ended is not None:  # stored by this node: what it stored
                        return msgspec.structs.replace(
                            record, state=ended.state, finished_at=ended.finished_at,
                            result=ended.result, error_code=ended.error_code,
                            error_message=ended.error_message)
            finally:
                waiting = self._waiters.get(key)
                if waiting and waiter in waiting:
                    waiting.remove(waiter)
                    if not waiting:
                        del self._waiters[key]

    async def get(self, key: str) -> JobRecord | None:
        return await self._read(key)

    async def _read_many(self, keys: list[str]) -> list[JobRecord | None]:
        rows = await self._fetch(pgbatches.READ, (keys,))
        records = {row["key"]: _record(row) for row in rows}
        return [records.get(key) for key in keys]

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

    async def waiting(self) -> dict[tuple[str, str | None], int]:
        """How many jobs wait, by model and variant."""
        rows = await self._fetch(f"SELECT model, variant, count(*) AS n FROM {T} "
                                 "WHERE state = 'queued' GROUP BY model, variant")
        return {(row["model"], row["variant"]): row["n"] for row in rows}

    async def claim(self, rooms: Mapping[str, int]) -> list[JobRecord]:
        hints = self._hints
        rooms = {model: n for model, n in rooms.items() if self._drained.get(model) != hints}
        if not rooms:
            return []
        rows = await self._fetch(f"""
            UPDATE {T} SET state = 'running', node = %(node)s, attempt = attempt + 1,
                lease_until = now() + make_interval(secs => %(lease)s),
                started_at = coalesce(started_at, %(now)s)
            WHERE key IN (
                SELECT picked.key
                FROM unnest(%(models)s::text[], %(variants)s::text[], %(limits)s::int[])
                    AS room(model, variant, n)
                CROSS JOIN LATERAL (
                    SELECT key FROM {T} AS j WHERE state = 'queued' AND model = room.model
                        AND (j.variant IS NULL OR j.variant = room.variant)
                    ORDER BY priority, submitted_at LIMIT room.n
                    FOR UPDATE SKIP LOCKED) AS picked)
            RETURNING {COLUMNS}""",
            {"node": self.node, "lease": self.lease_s, "models": list(rooms),
             "variants": [self.variant(model) for model in rooms],
             "limits": list(rooms.values()), "now": time.time()})
        records = sorted((_record(row) for row in rows),
                         key=lambda r: (PRIORITY_RANK[r.priority], r.submitted_at))
        claimed = collections.Counter(record.model for record in records)
        for record in records:
            self._held[record.key] = record.attempt
        for model in rooms:
            if not claimed[model]:  # (not fewer than asked: others may hold some a moment)
                self._drained[model] = hints
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
        ended = await self._end_waiting("key = %(key)s", "cancelled", ErrorCode.CANCELLED,
                                        " cancelled", key=key)
        if not ended:  # running somewhere: whoever runs it stops it
            await self._fetch("SELECT pg_notify('modelpool_cancel', %s)", (key,))
        return bool(ended)

    async def expire_waiting(self, now: float) -> list[JobRecord]:
        """Waiting jobs whose deadline passed end here, with their ending stored (by the
        server's clock, whichever node submitted them): none is left to the caller."""
        await self._end_waiting("deadline_at < now()", "failed", ErrorCode.DEADLINE_EXPIRED,
                                ": its deadline passed while it waited in the job queue")
        return []

    async def end_stranded(self, model: str, variant: str | None, why: str) -> int:
        """End every waiting job of a model and variant that no live node can run
        (MODEL_LOAD_FAILED, why); returns how many."""
        return len(await self._end_waiting(
            "model = %(model)s AND variant IS NOT DISTINCT FROM %(variant)s", "failed",
            ErrorCode.MODEL_LOAD_FAILED, why, model=model, variant=variant))

    async def _end_waiting(self, where: str, state: str, code: ErrorCode, why: str,
                           **params: str | None) -> list[str]:
        rows = await self._fetch(END_WAITING.format(T=T, where=where), {
            **params, "state": state, "code": code.value, "why": why, "now": time.time(),
            "keep": self.retention_s})
        return [row["key"] for row in rows if row["key"] is not None]

    async def sweep(self) -> int:
        self._hints += 1  # once a tick, every model's queue is looked at again
        rows = await self._fetch(f"""
            UPDATE {T} SET state = 'queued', node = '', lease_until = NULL
            WHERE state = 'running' AND lease_until < now()
            RETURNING pg_notify('modelpool_jobs', model)""")
        return len(rows)

    async def length(self) -> int:
        rows = await self._fetch(f"SELECT count(*) AS n FROM {T} WHERE state = 'queued'")
        return int(rows[0]["n"])


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
        attempt=row["attempt"], stream_to=row["stream_to"])
