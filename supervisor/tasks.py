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
from modelpool.supervisor.queueing import PRIORITY_RANK


class QueueFull(Exception):
    pass


class TaskQueue(Protocol):
    ready: asyncio.Event  # set when there may be jobs to claim
    on_cancel: Callable[[str], None] | None  # a job running here is to be cancelled

    async def put(self, record: JobRecord) -> None:
        """Queue an admitted job; QueueFull at the queue's bound."""

    async def waiting(self) -> dict[str, int]:
        """Jobs waiting to be claimed, by model."""

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
        self._cancelled: set[str] = set()
        self._count: collections.Counter[str] = collections.Counter()

    async def put(self, record: JobRecord) -> None:
        if sum(self._count.values()) >= self.max_queued:
            raise QueueFull(f"{self.max_queued} jobs are waiting ([jobs] max_queued)")
        rank = PRIORITY_RANK[record.priority]  # type: ignore[index]
        heapq.heappush(self._heaps[record.model], (rank, next(self._order), record))
        self._count[record.model] += 1
        self.ready.set()

    async def waiting(self) -> dict[str, int]:
        return {model: n for model, n in self._count.items() if n}

    async def claim(self, rooms: Mapping[str, int]) -> list[JobRecord]:
        claimed = []
        for model, limit in rooms.items():
            heap, taken = self._heaps.get(model, []), 0
            while heap and taken < limit:
                record = heapq.heappop(heap)[2]
                if record.key in self._cancelled:
                    self._cancelled.discard(record.key)
                    continue
                self._count[model] -= 1
                claimed.append(record)
                taken += 1
        return claimed

    async def complete(self, key: str) -> bool:
        return True  # nothing else could have taken it

    async def release(self, record: JobRecord) -> None:
        rank = PRIORITY_RANK[record.priority]  # type: ignore[index]
        heapq.heappush(self._heaps[record.model], (rank, -next(self._order), record))
        self._count[record.model] += 1

    async def extend(self, keys: list[str]) -> list[str]:
        return []  # claims in memory never lapse

    async def cancel(self, key: str) -> bool:
        for model, heap in self._heaps.items():
            if any(r.key == key for _, _, r in heap) and key not in self._cancelled:
                self._cancelled.add(key)  # dropped when it reaches the top
                self._count[model] -= 1
                return True
        return False

    async def sweep(self) -> int:
        return 0

    async def length(self) -> int:
        return sum(self._count.values())
