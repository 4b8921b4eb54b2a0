"""The per-model queue of jobs: priority first, then age; batches coalesced on pop.

A Job is one unit of work; its Requesters are the clients waiting for it (more than one
when identical requests were deduplicated). Pure data structures: no I/O, no clock.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from modelpool.protocol.kinds import Kind
from modelpool.protocol.messages import PRIORITIES, WorkRequest, encoder

PRIORITY_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
PROMOTION_FLOOR = PRIORITY_RANK["high"]  # ageing never lifts work into `critical`
DEDUP_MAX_BYTES = 1 << 20  # hashing bigger inputs costs more than it is likely to save
FINISH_TAGS_KEPT = 4096  # owners' finish tags kept before the idle ones are dropped


class ReplySink(Protocol):
    """Where replies go: a client connection."""

    closed: bool
    jobs: dict[int, Any]
    owner: Hashable  # who takes turns with other clients in the queues

    def send(self, msg: Any) -> None: ...


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class Requester:
    """One client request waiting on a job; gets exactly one final reply."""

    sink: ReplySink
    client_id: int
    priority: str
    accepted_at: float
    deadline_at: float | None = None
    timer: Any = None  # the loop's TimerHandle for its timeout or deadline
    done: bool = False
    job: Job | None = None


@dataclass(eq=False)
class Job:
    """One unit of work, from admission until its worker replies (or it is dropped)."""

    job_id: int  # unique in this daemon; the id used on worker pipes
    request: WorkRequest
    kind: Kind
    model_key: str
    accepted_at: float
    requesters: list[Requester] = field(default_factory=list)
    state: JobState = JobState.QUEUED
    rank: int | None = None  # current priority rank once queued; ageing lowers it
    entry: int | None = None  # the queue's current heap entry for it
    owner: Hashable = None  # whose turn it takes in fair queueing: its client
    worker_id: int | None = None
    started_at: float | None = None
    chunks_sent: int = 0
    retries: int = 0
    dedup_key: bytes | None = None
    nbytes: int = 0  # size of the request on the wire, for the queue's byte bound
    # A request larger than max_batch runs as parts, each queued on its own; the parent
    # holds the requesters and gathers the parts' rows in order.
    parent: Job | None = None
    parts: list[Job] = field(default_factory=list)
    part_replies: dict[int, Any] = field(default_factory=dict)
    history: list[Any] | None = None  # chunks so far, replayed to requesters who attach late
    size: int = field(init=False)  # units of batch capacity: texts, images, documents; or 1

    def __post_init__(self) -> None:
        self.size = self.kind.size(self.request)

    @property
    def live(self) -> list[Requester]:
        owner = self.parent or self
        return [r for r in owner.requesters if not r.done]


def dedup_key(kind: Kind, request: WorkRequest, model_key: str) -> bytes | None:
    """Identical work for identical inputs, or None when running it twice could differ
    (sampling without a seed) or the input is too large to be worth hashing."""
    if not kind.deterministic(request):
        return None
    neutral = msgspec.structs.replace(request, id=0, model=model_key, priority="normal",
                                      timeout_s=None, deadline_s=None, sent_at=None)
    payload = encoder.encode(neutral)
    if len(payload) > DEDUP_MAX_BYTES:
        return None
    return hashlib.blake2b(payload, digest_size=16).digest()


def aged_rank(rank: int, waited_s: float, promote_every_s: float) -> int:
    """One priority level up per promote_every_s of waiting, never into `critical`, so a
    steady stream of urgent work cannot starve `batch` forever."""
    if promote_every_s <= 0 or rank <= PROMOTION_FLOOR:
        return rank
    return max(PROMOTION_FLOOR, rank - int(waited_s // promote_every_s))


class JobQueue:
    """A min-heap on (rank, start tag, arrival order): priority first, then start-time
    fair queueing across owners (client connections) within a priority. Each owner's
    next job starts where its previous one finished (its start tag plus its size), and
    never before the tag of the job dispatched last; so one client with a thousand
    waiting requests and another with one take turns instead of queueing FIFO, and a
    lone client's jobs keep their arrival order.

    Removal and re-ranking are lazy: an entry whose job left QUEUED, or that is not the
    job's current entry (it was promoted or re-queued since), is skipped at the top."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Job]] = []
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)
        self._virtual = [0.0] * len(PRIORITIES)  # per rank: start tag last dispatched
        self._finish: dict[tuple[int, Hashable], float] = {}  # (rank, owner): last finish
        self.held: collections.Counter[Hashable] = collections.Counter()  # waiting, by owner
        self.live = 0
        self.nbytes = 0  # of the jobs waiting

    def __len__(self) -> int:
        return self.live

    def push(self, job: Job) -> None:
        rank = PRIORITY_RANK[job.request.priority]
        self._enqueue(job, rank, self._start_tag(rank, job), next(self._order))
        self._count(job, 1)

    def push_front(self, job: Job) -> None:
        """Re-queue ahead of everything of the same rank (a dead worker's job)."""
        rank = job.rank if job.rank is not None else PRIORITY_RANK[job.request.priority]
        self._enqueue(job, rank, -math.inf, next(self._front))
        self._count(job, 1)

    def promote(self, job: Job, rank: int) -> None:
        """Move a queued job up to rank (ageing, or a more urgent requester attached)."""
        if job.entry is not None and job.rank is not None and rank < job.rank:
            self._enqueue(job, rank, self._start_tag(rank, job), next(self._order))

    def discard(self, job: Job) -> None:
        """Call after moving a queued job out of QUEUED (cancelled, timed out); a job
        already popped (and then failed or expired before it ran) is not counted twice."""
        if job.entry is None:
            return
        job.entry = None
        self._count(job, -1)
        self._drop_dead_top()

    def pop_batch(self, max_size: int) -> list[Job]:
        """The best job, plus, for a batched kind, following jobs of the same kind while
        they fit in max_size."""
        self._drop_dead_top()
        if not self._heap:
            return []
        batch = [self._pop()]
        if not batch[0].kind.batched:
            return batch
        size = batch[0].size
        while size < max_size:
            self._drop_dead_top()
            if not self._heap:
                break
            nxt = self._heap[0][3]
            if nxt.size + size > max_size or nxt.kind is not batch[0].kind:
                break
            batch.append(self._pop())
            size += nxt.size
        return batch

    def jobs(self) -> list[Job]:
        seen: set[int] = set()
        out = []
        for *_, job in self._heap:
            if job.state is JobState.QUEUED and job.job_id not in seen:
                seen.add(job.job_id)
                out.append(job)
        return out

    def _start_tag(self, rank: int, job: Job) -> float:
        key = (rank, job.owner)
        start = max(self._virtual[rank], self._finish.get(key, 0.0))
        self._finish[key] = start + job.size
        if len(self._finish) > FINISH_TAGS_KEPT:
            self._forget_idle_owners()
        return start

    def _forget_idle_owners(self) -> None:
        """An owner whose last finish is behind its rank's clock starts from the clock
        anyway: its entry says nothing."""
        self._finish = {key: finish for key, finish in self._finish.items()
                        if finish > self._virtual[key[0]]}

    def _enqueue(self, job: Job, rank: int, tag: float, order: int) -> None:
        job.rank, job.entry = rank, order
        heapq.heappush(self._heap, (rank, tag, order, job))

    def _count(self, job: Job, delta: int) -> None:
        self.live += delta
        self.nbytes += delta * job.nbytes
        self.held[job.owner] += delta
        if not self.held[job.owner]:
            del self.held[job.owner]

    def _pop(self) -> Job:
        rank, tag, _, job = heapq.heappop(self._heap)
        if tag > self._virtual[rank]:
            self._virtual[rank] = tag
        self._count(job, -1)
        job.entry = None  # out of the queue
        return job

    def _drop_dead_top(self) -> None:
        while self._heap:
            _, _, order, job = self._heap[0]
            if job.state is JobState.QUEUED and order == job.entry:
                return
            heapq.heappop(self._heap)
