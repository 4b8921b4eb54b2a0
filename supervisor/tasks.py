"""Where submitted jobs wait to be run: the TaskQueue interface, and the in-memory queue
that is the embedded default.

A daemon claims waiting jobs when its pool has room for them (JobService.pump), best
first: priority, then age. The queue takes them back: complete (ran here), release (not
finished here: it waits again), extend (renew the claims of jobs still running here).
With a shared queue (PostgreSQL) a claim is a lease that another daemon takes over if
this one stops renewing it; in memory, claims never lapse.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from collections.abc import Callable, Mapping
from typing import Protocol

from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.owners import share_of
from modelpool.supervisor.queueing import PRIORITY_RANK


class QueueFull(Exception):
    pass


class TaskQueue(Protocol):
    ready: asyncio.Event  # set when there may be jobs to claim
    on_cancel: Callable[[str], None] | None  # a job running here is to be cancelled
    # [jobs] max_queued: jobs waiting, then QueueFull (a reload sets it); one user may hold
    # three quarters of it, one tenant of a user three quarters of that (owners.share_of).
    max_queued: int

    async def put(self, record: JobRecord) -> None:
        """Queue an admitted job; QueueFull at the queue's bound."""

    async def claim(self, rooms: Mapping[str, int]) -> list[JobRecord]:
        """For each model, up to its room of its best waiting jobs, now this daemon's to
        run (in one go: a shared queue claims for every model in one statement)."""

    async def complete(self, key: str) -> bool:
        """The job ended here; False when this daemon no longer held it."""

    async def release(self, record: JobRecord) -> None:
        """The job did not run here (no room after all, or the daemon stops): it waits
        again."""

    async def extend(self, keys: list[str]) -> list[str]:
        """Renew the claims of jobs running here; returns the keys no longer held."""

    async def cancel(self, key: str) -> bool:
        """Take a waiting job out (True), or ask whoever runs it to stop."""

    async def expire_waiting(self, now: float) -> list[JobRecord]:
        """Take out the waiting jobs whose deadline has passed; returns those whose
        ending the caller stores (a shared queue stores them itself)."""

    async def sweep(self) -> int:
        """Put jobs whose claims lapsed back in the queue; returns how many."""

    async def length(self) -> int: ...


class MemoryTaskQueue:
    def __init__(self, max_queued: int) -> None:
        self.ready = asyncio.Event()
        self.on_cancel: Callable[[str], None] | None = None
        self.max_queued = max_queued
        self._heaps: dict[str, list[tuple[int, int, JobRecord]]] = collections.defaultdict(list)
        self._order = itertools.count()
        # The jobs waiting, by key: one taken out otherwise than by a claim (cancelled,
        # expired) stays in its heap until it reaches the top, and is dropped there.
        self._waiting: dict[str, JobRecord] = {}
        self._held: collections.Counter[tuple[int, str | None]] = collections.Counter()
        # Keys, not records: a job that ran keeps no request alive until its deadline.
        self._deadlines: list[tuple[float, int, str]] = []

    async def put(self, record: JobRecord) -> None:
        if len(self._waiting) >= self.max_queued:
            raise QueueFull(f"{self.max_queued} jobs are waiting ([jobs] max_queued)")
        user = share_of(self.max_queued)
        if self._held[record.uid, None] >= user:
            raise QueueFull(f"{user} of this user's jobs are waiting: the rest of [jobs] "
                            "max_queued is kept for others")
        tenant = share_of(user)
        if record.tenant and self._held[record.uid, record.tenant] >= tenant:
            raise QueueFull(f"{tenant} of this tenant's jobs are waiting: the rest of its "
                            "user's share of [jobs] max_queued is kept for others")
        self._push(record, next(self._order))
        self.ready.set()

    def _push(self, record: JobRecord, order: int) -> None:
        rank = PRIORITY_RANK[record.priority]  # type: ignore[index]
        heapq.heappush(self._heaps[record.model], (rank, order, record))
        if record.deadline_at is not None:
            heapq.heappush(self._deadlines, (record.deadline_at, order, record.key))
        self._waiting[record.key] = record
        self._hold(record, 1)

    def _take(self, key: str) -> JobRecord | None:
        record = self._waiting.pop(key, None)
        if record is not None:
            self._hold(record, -1)
        return record

    def _hold(self, record: JobRecord, jobs: int) -> None:
        """Waiting jobs by user, (uid, None), and by tenant, (uid, tenant); none kept at 0."""
        holders = [(record.uid, None)] + ([(record.uid, record.tenant)] if record.tenant else [])
        for holder in holders:
            self._held[holder] += jobs
            if not self._held[holder]:
                del self._held[holder]

    async def claim(self, rooms: Mapping[str, int]) -> list[JobRecord]:
        claimed = []
        for model, limit in rooms.items():
            heap, taken = self._heaps.get(model, []), 0
            while heap and taken < limit:
                record = heapq.heappop(heap)[2]
                if self._waiting.get(record.key) is record:
                    self._take(record.key)
                    claimed.append(record)
                    taken += 1
        return claimed

    async def complete(self, key: str) -> bool:
        return True  # nothing else could have taken it

    async def release(self, record: JobRecord) -> None:
        self._push(record, -next(self._order))  # ahead of its equals: it waited longest

    async def extend(self, keys: list[str]) -> list[str]:
        return []  # claims in memory never lapse

    async def cancel(self, key: str) -> bool:
        return self._take(key) is not None

    async def expire_waiting(self, now: float) -> list[JobRecord]:
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            record = self._take(heapq.heappop(self._deadlines)[2])
            if record is not None:
                expired.append(record)
        return expired

    async def sweep(self) -> int:
        return 0

    async def length(self) -> int:
        return len(self._waiting)
