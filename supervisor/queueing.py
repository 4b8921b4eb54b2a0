"""The per-model queue of jobs: priority first, then age; batches coalesced on pop.

Pure data structure (no I/O, no clock of its own) so it can be tested with fakes.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.messages import PRIORITIES, Embed, Generate

PRIORITY_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}


class ReplySink(Protocol):
    """Where a job's replies go: a client connection."""

    closed: bool

    def send(self, msg: Any) -> None: ...


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class Job:
    """One accepted client request, from admission to its one final reply."""

    job_id: int  # unique in this daemon; the id used on worker pipes
    request: Embed | Generate
    sink: ReplySink
    model_key: str
    accepted_at: float
    state: JobState = JobState.QUEUED
    worker_id: int | None = None
    started_at: float | None = None
    chunks_sent: int = 0
    retries: int = 0
    timer: Any = None  # the loop's TimerHandle for timeout_s
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def client_id(self) -> int:
        return self.request.id

    @property
    def size(self) -> int:
        """Units of batch capacity: texts for embeddings, 1 for everything else."""
        return len(self.request.texts) if isinstance(self.request, Embed) else 1


class JobQueue:
    """A min-heap on (priority rank, arrival order). Removal is lazy: a job that left the
    QUEUED state is skipped when it reaches the top."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Job]] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def push(self, job: Job) -> None:
        rank = PRIORITY_RANK[job.request.priority]
        heapq.heappush(self._heap, (rank, next(self._order), job))
        self.live += 1

    def push_front(self, job: Job) -> None:
        """Re-queue ahead of everything of the same priority (a dead worker's job)."""
        rank = PRIORITY_RANK[job.request.priority]
        heapq.heappush(self._heap, (rank, next(self._front), job))
        self.live += 1

    def discard(self, job: Job) -> None:
        """Call after moving a queued job out of QUEUED (cancelled, timed out)."""
        self.live -= 1
        self._drop_dead_top()

    def pop_batch(self, max_size: int, batched: bool) -> list[Job]:
        """The best job, plus following compatible jobs while they fit in max_size."""
        self._drop_dead_top()
        if not self._heap:
            return []
        batch = [self._pop()]
        if not batched:
            return batch
        size = batch[0].size
        while size < max_size:
            self._drop_dead_top()
            if not self._heap:
                break
            nxt = self._heap[0][2]
            if nxt.size + size > max_size:
                break
            batch.append(self._pop())
            size += nxt.size
        return batch

    def jobs(self) -> list[Job]:
        return [job for _, _, job in self._heap if job.state is JobState.QUEUED]

    def _pop(self) -> Job:
        job = heapq.heappop(self._heap)[2]
        self.live -= 1
        return job

    def _drop_dead_top(self) -> None:
        while self._heap and self._heap[0][2].state is not JobState.QUEUED:
            heapq.heappop(self._heap)
