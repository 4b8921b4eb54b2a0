"""The per-model queue of jobs: priority first, then fair turns between users and
between each user's clients; batches coalesced on pop.

A Job is one unit of work; its Requesters are the clients waiting for it (more than one
when identical requests were deduplicated). Pure data structures: no I/O, no clock.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from modelpool.protocol.fields import PRIORITIES
from modelpool.protocol.kinds import Kind
from modelpool.protocol.messages import WorkRequest
from modelpool.supervisor.owners import Tenant, user_of

PRIORITY_RANK = {name: rank for rank, name in enumerate(PRIORITIES)}
FINISH_TAGS_KEPT = 4096  # owners' finish tags kept before the idle ones are dropped


class ReplySink(Protocol):
    """Where replies go: a client connection."""

    closed: bool
    jobs: dict[int, Any]
    owner: Hashable  # (uid, sub): who takes turns in the queues; see user_of

    def send(self, msg: Any) -> None: ...


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class Requester(msgspec.Struct, eq=False):
    """One client request waiting on a job; gets exactly one final reply."""

    sink: ReplySink
    client_id: int
    priority: str
    accepted_at: float
    deadline_at: float | None = None
    done: bool = False
    job: Job | None = None


class Job(msgspec.Struct, eq=False):
    """One unit of work, from admission until its worker replies (or it is dropped). One
    is made per request: a msgspec Struct, made and read in C (a slotted dataclass's
    generated __init__ took twice as long), with no default factories."""

    job_id: int  # unique in this daemon; the id used on worker pipes
    request: WorkRequest
    kind: Kind
    model_key: str
    accepted_at: float
    requesters: list[Requester]  # waiting for it (a part's are its parent's)
    size: int  # units of batch capacity: texts, images, documents; or 1 (kind.size)
    owner: Hashable  # whose turn it takes in fair queueing: its client, (uid, sub)
    user: Hashable  # user_of(owner): whose turn it takes among users
    state: JobState = JobState.QUEUED
    rank: int | None = None  # current priority rank once queued; ageing lowers it
    entry: int | None = None  # the queue's current heap entry for it
    worker_id: int | None = None
    started_at: float | None = None
    chunks_sent: int = 0
    retries: int = 0
    dedup_key: bytes | None = None
    nbytes: int = 0  # size of the request on the wire, for the queue's byte bound
    # A request larger than max_batch runs as parts, each queued on its own; the parent
    # holds the requesters and gathers the parts' rows (by job id) in order.
    parent: Job | None = None
    parts: tuple[Job, ...] = ()
    part_replies: dict[int, Any] | None = None
    history: list[Any] | None = None  # chunks so far, replayed to requesters who attach late

    @classmethod
    def of(cls, job_id: int, request: WorkRequest, kind: Kind, model_key: str,
           accepted_at: float, owner: Hashable, **fields: Any) -> Job:
        """A part of a split request (no requesters of its own), its size and user found."""
        return cls(job_id, request, kind, model_key, accepted_at, [], kind.size(request),
                   owner, user_of(owner), **fields)

    @property
    def live(self) -> list[Requester]:
        owner = self.parent or self
        return [r for r in owner.requesters if not r.done]


def _forget_behind(finish: dict[Hashable, float], clock: float) -> None:
    """A finish tag behind its clock says nothing (the next start is the clock anyway):
    drop those, so departed clients do not accumulate."""
    for key in [key for key, tag in finish.items() if tag <= clock]:
        del finish[key]


@dataclass(eq=False, slots=True)
class _User:
    """One user's work at one priority. Its owners (connections, its jobs) take turns by
    start-time fair queueing among themselves; `start` is where the user's next dispatch
    begins on its priority's clock, where it takes turns with the other users (while it
    has none waiting: where its last one finished)."""

    uid: Hashable
    start: float = 0.0
    seq: int = -1  # of its current entry in its level's heap of users, while live
    heap: list[tuple[float, int, Job]] = field(default_factory=list)  # (tag, order, job)
    finish: dict[Hashable, float] = field(default_factory=dict)  # owner: its last finish
    clock: float = 0.0  # the tag of its job dispatched last
    live: int = 0

    def top(self) -> Job:
        heap = self.heap
        while heap[0][1] != heap[0][2].entry:  # removed, promoted or re-queued since
            heapq.heappop(heap)
        return heap[0][2]

    def push(self, job: Job, order: int) -> None:
        self.live += 1
        tag = self.finish.get(job.owner, 0.0)
        tag = tag if tag > self.clock else self.clock
        self.finish[job.owner] = tag + job.size
        if len(self.finish) > FINISH_TAGS_KEPT:
            _forget_behind(self.finish, self.clock)
        heapq.heappush(self.heap, (tag, order, job))


@dataclass(eq=False, slots=True)
class _Level:
    """The waiting work of one priority: re-queued jobs first (last in, first out), then
    the users' work, user against user by start tag, each user's own owners within."""

    front: list[tuple[int, Job]] = field(default_factory=list)  # (order, job)
    users: dict[Hashable, _User] = field(default_factory=dict)  # those seen lately
    heap: list[tuple[float, int, Hashable]] = field(default_factory=list)  # (start, seq, uid)
    clock: float = 0.0  # the start tag of the user dispatched last
    live: int = 0

    def top(self) -> tuple[Job, _User | None]:
        front = self.front
        while front and front[0][0] != front[0][1].entry:
            heapq.heappop(front)
        if front:
            return front[0][1], None
        while True:
            _, seq, uid = self.heap[0]
            user = self.users.get(uid)
            if user is not None and user.seq == seq and user.live:
                return user.top(), user
            heapq.heappop(self.heap)  # that user's work left since

    def wake(self, uid: Hashable, seq: int) -> _User:
        """A user with nothing waiting here until now: its turn starts at the clock, or
        where its last one finished if that is later (idleness banks no turns)."""
        user = self.users.get(uid)
        if user is None:
            if len(self.users) > FINISH_TAGS_KEPT:
                self._forget_idle()
            user = self.users[uid] = _User(uid)
        user.heap.clear()  # what is left is skipped entries
        user.start, user.seq = max(self.clock, user.start), seq
        heapq.heappush(self.heap, (user.start, seq, uid))
        return user

    def _forget_idle(self) -> None:
        """Users with nothing waiting whose turn is behind the clock say nothing."""
        for uid in [uid for uid, user in self.users.items()
                    if not user.live and user.start <= self.clock]:
            del self.users[uid]

    def served(self, user: _User, job: Job, seq: int) -> None:
        """The user's top job (job) is dispatched: advance both clocks and its turn."""
        tag = heapq.heappop(user.heap)[0]
        if tag > user.clock:
            user.clock = tag
        if user.start > self.clock:
            self.clock = user.start
        user.start += job.size
        self.live -= 1
        user.live -= 1
        if user.live:
            user.seq = seq
            heapq.heapreplace(self.heap, (user.start, seq, user.uid))
        else:
            heapq.heappop(self.heap)

    def remove(self, job: Job) -> None:
        """Its current entry no longer counts (it is left in its heap, skipped later)."""
        self.live -= 1
        if job.entry is not None and job.entry < 0:  # in the front of the line
            return
        self.users[job.user].live -= 1


@dataclass(slots=True)
class QueuedTotals:
    """What all models' queues hold together, kept as they change: the daemon-wide bounds
    are checked for every request (summing four models' queues was ~5% of its opcodes)."""

    live: int = 0
    nbytes: int = 0


class JobQueue:
    """Priority first; within a priority, hierarchical start-time fair queueing: users
    (peer uids) take equal turns, and within a user its owners (its connections, its
    submitted jobs) take equal turns; turns are weighted by size. A tag is where a job
    starts on its clock: an owner's next job starts where its previous one finished,
    never before the tag dispatched last, and likewise a user's next dispatch on the
    priority's clock. So one user flooding through four connections and another with
    one request take turns, and a lone client's jobs keep their arrival order. Both
    levels are heaps: O(log n) a push or pop.

    Removal and re-ranking are lazy: an entry that is not its job's current entry (the
    job was popped, discarded, promoted or re-queued since) is skipped at the top."""

    def __init__(self, totals: QueuedTotals | None = None) -> None:
        self.totals = QueuedTotals() if totals is None else totals  # the pool's: shared
        self._levels = [_Level() for _ in PRIORITIES]
        self._order = itertools.count()
        self._front = itertools.count(-1, -1)
        self._seq = itertools.count()
        # Waiting, by user and by Tenant owner (a dict: a Counter was slower).
        self.held: dict[Hashable, int] = {}
        self.served = [0] * len(PRIORITIES)  # jobs handed out, by the rank they left
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def push(self, job: Job) -> None:
        self._place(job, PRIORITY_RANK[job.request.priority], front=False)
        self._count(job.user, 1, job.nbytes, job.owner)

    def push_front(self, job: Job) -> None:
        """Re-queue ahead of everything of the same rank (a dead worker's job)."""
        rank = job.rank if job.rank is not None else PRIORITY_RANK[job.request.priority]
        self._place(job, rank, front=True)
        self._count(job.user, 1, job.nbytes, job.owner)

    def promote(self, job: Job, rank: int) -> None:
        """Move a queued job up to rank (ageing, or a more urgent requester attached)."""
        if job.entry is not None and job.rank is not None and rank < job.rank:
            self._levels[job.rank].remove(job)
            self._place(job, rank, front=False)

    def discard(self, job: Job) -> None:
        """Call after moving a queued job out of QUEUED (cancelled, timed out); a job
        already popped (and then failed or expired before it ran) is not counted twice."""
        if job.entry is None or job.rank is None:
            return
        self._levels[job.rank].remove(job)
        job.entry = None
        self._count(job.user, -1, -job.nbytes, job.owner)

    def peek(self) -> Job | None:
        """The job pop_batch would hand out first."""
        top = self._top()
        return None if top is None else top[1]

    def pop_batch(self, max_size: int) -> list[Job]:
        """The best job, plus, for a batched kind, following jobs of the same kind while
        they fit in max_size."""
        top = self._top()
        if top is None:
            return []
        first = top[1]
        batch = [self._take(*top)]
        if not first.kind.batched:
            return batch
        size = first.size
        while size < max_size and self.live and (top := self._top()) is not None:
            level, nxt, user = top
            if nxt.size + size > max_size or nxt.kind is not first.kind:
                break
            if user is not None and user.live == level.live:  # its level's only user
                size = self._take_run(level, user, batch, size, max_size)
            else:
                batch.append(self._take(*top))
                size += nxt.size
        return batch

    def _take_run(self, level: _Level, user: _User, batch: list[Job], size: int,
                  max_size: int) -> int:
        """Take the jobs of the only user with work at its level, in its order, while they
        fit (the first does): as _take each would, the level's heap and counts moved once."""
        kind, heap, taken, nbytes = batch[0].kind, user.heap, 0, 0
        tag = started = 0.0
        while size < max_size and user.live:
            job = user.top()
            if job.state is not JobState.QUEUED:
                self.discard(job)  # as _top does: never hand it out
                continue
            if job.size + size > max_size or job.kind is not kind:
                break
            tag, started = heapq.heappop(heap)[0], user.start
            user.start += job.size
            user.live -= 1
            job.entry = None
            batch.append(job)
            size += job.size
            taken += 1
            nbytes += job.nbytes
            if isinstance(job.owner, Tenant):
                self._hold(job.owner, -1)
        user.clock = max(user.clock, tag)
        level.clock = max(level.clock, started)
        level.live -= taken
        if user.live:
            user.seq = next(self._seq)
            heapq.heapreplace(level.heap, (user.start, user.seq, user.uid))
        else:
            heapq.heappop(level.heap)
        self.served[batch[-1].rank or 0] += taken
        self._count(user.uid, -taken, -nbytes)
        return size

    def jobs(self) -> list[Job]:
        return [job for rank in range(len(self._levels)) for job in self._jobs_at(rank)]

    def waiting(self, rank: int) -> bool:
        return self._levels[rank].live > 0

    def lift(self, rank: int) -> None:
        """Every job waiting at rank up one level, in the order they came."""
        for job in sorted(self._jobs_at(rank), key=lambda job: job.entry or 0):
            front = job.entry is not None and job.entry < 0
            self._levels[rank].remove(job)
            self._place(job, rank - 1, front)

    def _jobs_at(self, rank: int) -> list[Job]:
        level = self._levels[rank]
        out = [job for order, job in level.front if order == job.entry]
        for user in level.users.values():
            out += [job for _, order, job in user.heap if order == job.entry]
        return [job for job in out if job.state is JobState.QUEUED]

    def _place(self, job: Job, rank: int, front: bool) -> None:
        level = self._levels[rank]
        level.live += 1
        job.rank = rank
        if front:
            job.entry = next(self._front)
            heapq.heappush(level.front, (job.entry, job))
            return
        user = level.users.get(job.user)
        if user is None or not user.live:
            user = level.wake(job.user, next(self._seq))
        job.entry = next(self._order)
        user.push(job, job.entry)

    def _top(self) -> tuple[_Level, Job, _User | None] | None:
        """The best job waiting, its priority's level and its user (None: re-queued)."""
        for level in self._levels:
            while level.live:
                job, user = level.top()
                if job.state is JobState.QUEUED:
                    return level, job, user
                self.discard(job)  # it left QUEUED without a discard: never hand it out
        return None

    def _take(self, level: _Level, job: Job, user: _User | None) -> Job:
        """Pop the job _top just returned."""
        if user is None:
            heapq.heappop(level.front)
            level.live -= 1
        else:
            level.served(user, job, next(self._seq))
        job.entry = None  # out of the queue
        self.served[job.rank or 0] += 1
        self._count(job.user, -1, -job.nbytes, job.owner)
        return job

    def _count(self, user: Hashable, jobs: int, nbytes: int, owner: Hashable = None) -> None:
        """Jobs of one user, of nbytes together, come (jobs > 0) or leave (< 0) the queue;
        a tenant's are counted for it too (its share within its user's, in admission)."""
        self.live += jobs
        totals = self.totals
        totals.live += jobs
        totals.nbytes += nbytes
        self._hold(user, jobs)
        if isinstance(owner, Tenant):
            self._hold(owner, jobs)

    def _hold(self, holder: Hashable, jobs: int) -> None:
        held = self.held.get(holder, 0) + jobs
        if held:
            self.held[holder] = held
        else:
            del self.held[holder]
