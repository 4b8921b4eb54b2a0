"""Where submitted jobs wait to be run: the TaskQueue interface, and the in-memory queue
that is the embedded default.

The queue gives admitted jobs to a daemon that has room for them (claim), and takes
them back: complete (ran here, its claim ends), release (not finished here: someone
may run it), extend (renew the claims of jobs still running here). In memory every job
is claimed by the one daemon at once, so the pool's own queue does the waiting; a shared
queue (PostgreSQL) holds jobs until a daemon with room claims them, and a claim is a
lease that another daemon takes over if this one stops renewing it.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol

from modelpool.supervisor.mailbox import JobRecord


class TaskQueue(Protocol):
    ready: asyncio.Event  # set when claim may return jobs

    async def put(self, record: JobRecord) -> None: ...

    async def claim(self, limit: int) -> list[JobRecord]: ...

    async def complete(self, key: str) -> bool:
        """False when this daemon no longer held the job (its lease was lost)."""

    async def release(self, key: str) -> None: ...

    async def extend(self, keys: list[str]) -> None: ...

    async def cancel(self, key: str) -> bool:
        """Take a job that no one has claimed yet out of the queue."""

    async def length(self) -> int: ...


class MemoryTaskQueue:
    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self._waiting: collections.deque[JobRecord] = collections.deque()
        self._claimed: set[str] = set()

    async def put(self, record: JobRecord) -> None:
        self._waiting.append(record)
        self.ready.set()

    async def claim(self, limit: int) -> list[JobRecord]:
        claimed = []
        while self._waiting and len(claimed) < limit:
            record = self._waiting.popleft()
            self._claimed.add(record.key)
            claimed.append(record)
        if not self._waiting:
            self.ready.clear()
        return claimed

    async def complete(self, key: str) -> bool:
        if key not in self._claimed:
            return False
        self._claimed.discard(key)
        return True

    async def release(self, key: str) -> None:
        self._claimed.discard(key)  # in memory, nothing outlives the daemon to run it

    async def extend(self, keys: list[str]) -> None:
        return None  # claims in memory never lapse

    async def cancel(self, key: str) -> bool:
        for record in self._waiting:
            if record.key == key:
                self._waiting.remove(record)
                return True
        return False

    async def length(self) -> int:
        return len(self._waiting)
