"""Where submitted jobs' records and results are kept until they expire: the Mailbox
interface, and the in-memory mailbox that is the embedded default.

A record is created when a job is submitted, marked when it starts and when it ends
(the first ending wins: a late duplicate from a job run twice is dropped), waited for by
retrieve, and removed `result_retention_s` after it ended, or when forgotten. The
in-memory mailbox lives and dies with the daemon.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import msgspec

from modelpool.protocol.jobs import ENDED, JobInfo
from modelpool.supervisor.clock import Scheduler


class JobRecord(msgspec.Struct, kw_only=True):
    """A submitted job as the queue and the mailbox keep it (encodable as it is)."""

    key: str
    uid: int  # whose it is: the submitting user
    op: str
    model: str
    priority: str
    request: bytes  # the WorkRequest, msgpack
    single: bool = False
    dedup: bytes | None = None  # identical work has the same key (None: may differ)
    # In a cluster: the variant of the model's config that accepted it (cluster_view.py);
    # only nodes that configure the model alike claim it. None: any node may.
    variant: str | None = None
    # A relayed stream: the channel its text goes to as it is made (pgstreams.py).
    stream_to: str | None = None
    tenant: str = ""  # its request's: whose share of the bound on waiting jobs it takes
    submitted_at: float  # seconds since the epoch, as every time here
    state: str = "queued"
    started_at: float | None = None
    finished_at: float | None = None
    node: str = ""
    result: bytes | None = None  # the final reply (Embeddings, Scores, Completion, Image)
    error_code: str | None = None
    error_message: str | None = None
    attempt: int = 0  # how many claims it has had: a shared queue's fencing token
    # When the client's deadline passes (seconds since the epoch, this daemon's clock):
    # a job still waiting then ends DEADLINE_EXPIRED.
    deadline_at: float | None = None

    @property
    def nbytes(self) -> int:
        return len(self.request) + len(self.result or b"")

    def info(self) -> JobInfo:
        return JobInfo(key=self.key, op=self.op, model=self.model, priority=self.priority,
                       state=self.state, submitted_at=self.submitted_at,  # type: ignore[arg-type]
                       started_at=self.started_at, finished_at=self.finished_at,
                       error_code=self.error_code, error_message=self.error_message,
                       node=self.node)


class MailboxFull(Exception):
    pass


class Mailbox(Protocol):
    retention_s: float  # [jobs] result_retention_s (a reload sets it)
    max_bytes: int  # [jobs] max_mailbox_bytes: then MailboxFull

    async def add(self, record: JobRecord, claim: bool = False) -> None:
        """A newly submitted job; MailboxFull when the mailbox is at its bound. With
        claim (the caller can run it now), a shared store may hand it to the caller at
        once, record.state "running", instead of queueing it for every node to claim."""

    async def start(self, key: str, node: str, at: float) -> None: ...

    async def finish(self, key: str, outcome: JobRecord) -> bool:
        """The job ended (outcome carries state, result or error, finished_at); False
        when it had ended already: the first ending wins."""

    async def wait(self, key: str, timeout_s: float, uid: int) -> JobRecord | None:
        """The record once it has ended, or as it is when timeout_s has passed; None at
        once for a key it does not have or that is not uid's."""

    async def get(self, key: str) -> JobRecord | None: ...

    async def remove(self, key: str) -> bool: ...

    async def recent(self, uid: int, limit: int) -> list[JobRecord]: ...

    async def expire(self, now: float) -> int:
        """Remove what ended more than the retention ago; returns how many."""

    async def usage(self) -> tuple[int, int]:
        """(records held, bytes held)."""


class MemoryMailbox:
    def __init__(self, scheduler: Scheduler, retention_s: float, max_bytes: int) -> None:
        self.scheduler = scheduler
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self._records: dict[str, JobRecord] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._bytes = 0

    async def add(self, record: JobRecord, claim: bool = False) -> None:
        if self._bytes >= self.max_bytes:
            raise MailboxFull(f"the mailbox holds {self._bytes >> 20} MiB "
                              f"(max_mailbox_bytes {self.max_bytes >> 20} MiB)")
        self._records[record.key] = record
        self._bytes += record.nbytes

    async def start(self, key: str, node: str, at: float) -> None:
        record = self._records.get(key)
        if record is not None and record.state == "queued":
            record.state, record.started_at, record.node = "running", at, node

    async def finish(self, key: str, outcome: JobRecord) -> bool:
        record = self._records.get(key)
        if record is None or record.state in ENDED:
            return False
        self._bytes -= record.nbytes
        record.state, record.finished_at = outcome.state, outcome.finished_at
        record.result = outcome.result
        record.error_code, record.error_message = outcome.error_code, outcome.error_message
        self._bytes += record.nbytes
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)
        return True

    async def wait(self, key: str, timeout_s: float, uid: int) -> JobRecord | None:
        record = self._records.get(key)
        if record is None or record.uid != uid:
            return None
        if record.state in ENDED or timeout_s <= 0:
            return record
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(waiter)
        timer = self.scheduler.call_later(timeout_s, lambda: waiter.done()
                                          or waiter.set_result(None))
        try:
            await waiter
        finally:
            timer.cancel()
            waiting = self._waiters.get(key)
            if waiting and waiter in waiting:
                waiting.remove(waiter)
        return self._records.get(key)

    async def get(self, key: str) -> JobRecord | None:
        return self._records.get(key)

    async def remove(self, key: str) -> bool:
        record = self._records.pop(key, None)
        if record is None:
            return False
        self._bytes -= record.nbytes
        for waiter in self._waiters.pop(key, []):
            if not waiter.done():
                waiter.set_result(None)
        return True

    async def recent(self, uid: int, limit: int) -> list[JobRecord]:
        mine = [r for r in self._records.values() if r.uid == uid]
        return sorted(mine, key=lambda r: r.submitted_at, reverse=True)[:limit]

    async def expire(self, now: float) -> int:
        old = [key for key, r in self._records.items()
               if r.finished_at is not None and now - r.finished_at >= self.retention_s]
        for key in old:
            await self.remove(key)
        return len(old)

    async def usage(self) -> tuple[int, int]:
        return len(self._records), self._bytes
