"""The requesters of every job: their timers, their one final reply each, the fan-out of
a deduplicated job's replies, and the parts of a split request gathered back in order.

The book owns requesters and the dedup index; what a job's end means for its model (its
queue, its metrics, a stream to abort) it reports to JobEvents, which the pool is.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Hashable
from typing import Any, Protocol

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.kinds import Kind, merge_rows
from modelpool.protocol.messages import Error, WorkRequest, encoder
from modelpool.supervisor.clock import ExpiryHeap, Scheduler
from modelpool.supervisor.owners import user_of
from modelpool.supervisor.queueing import Job, JobState, ReplySink, Requester

DEDUP_MAX_BYTES = 1 << 20  # hashing bigger inputs costs more than it is likely to save
DIGEST_BYTES = 16
# Requests up to this size are their own dedup key in the index (up to twice their
# bytes while they wait); longer ones are digested.
INDEX_KEY_MAX_BYTES = 4096


class JobEvents(Protocol):
    def abandon(self, job: Job) -> None:
        """Nobody waits for this job any more: stop it if a worker is streaming it."""

    def wait_cause(self, job: Job) -> str:
        """Why the job has not finished yet, for TIMEOUT and DEADLINE_EXPIRED messages."""

    def job_closed(self, job: Job, was_queued: bool) -> None:
        """The job is done, for good or ill; it was still in its model's queue if asked."""

    def request_ended(self, req: Requester, reply: Any) -> None:
        """One requester got its final reply (None: its client left without one)."""


class JobBook:
    def __init__(self, scheduler: Scheduler, events: JobEvents) -> None:
        self.scheduler = scheduler
        self.expiries = ExpiryHeap(scheduler, self.expire)  # requesters' timeouts, deadlines
        self.events = events
        self.index: dict[bytes, Job] = {}  # dedup: key -> the job doing that work
        self._job_ids = itertools.count(1)

    # ---- admission -------------------------------------------------------------------

    def key_for(self, kind: Kind, request: WorkRequest, model_key: str) -> bytes | None:
        """The request's dedup key in this book's index (None: never joined)."""
        return dedup_key(kind, request, model_key, INDEX_KEY_MAX_BYTES)

    def leader_for(self, key: bytes | None) -> Job | None:
        """The job already doing this work (same dedup key), if any."""
        job = self.index.get(key) if key else None
        return job if job is not None and job.state is not JobState.DONE else None

    def requester(self, sink: ReplySink, request: WorkRequest, timeout_s: float,
                  deadline_in_s: float | None) -> Requester:
        """Register the client's request; it expires at its timeout or its deadline."""
        now = self.scheduler.now()
        req = Requester(sink, request.id, request.priority, now,
                        None if deadline_in_s is None else now + deadline_in_s)
        sink.jobs[request.id] = req
        expires_at = now + max(0.0, timeout_s)
        if req.deadline_at is not None and req.deadline_at < expires_at:
            expires_at = req.deadline_at
        self.expiries.add(expires_at, req)
        return req

    def attach(self, req: Requester, leader: Job) -> None:
        """An identical request is already waiting or running: share its result."""
        leader.requesters.append(req)
        req.job = leader
        for chunk in leader.history or []:  # a stream already under way: replay it
            req.sink.send(msgspec.structs.replace(chunk, id=req.client_id))

    def new_job(self, req: Requester, kind: Kind, request: WorkRequest, model_key: str,
                key: bytes | None, owner: Hashable) -> Job:
        """`owner`: whose turn it takes (owners.owner_of)."""
        job = Job(next(self._job_ids), request, kind, model_key, req.accepted_at, [req],
                  kind.size(request), owner, user_of(owner))
        req.job = job
        if key:
            job.dedup_key = key
            if kind.streaming:
                job.history = []
            self.index[key] = job
        return job

    def split(self, job: Job, max_batch: int) -> tuple[Job, ...]:
        """Parts of at most max_batch inputs, so one huge request is spread over workers
        and interleaves with other work instead of holding a worker for its whole length."""
        requests = job.kind.split(job.request, max_batch)
        job.parts = tuple(Job.of(next(self._job_ids), part_request, job.kind, job.model_key,
                                 job.accepted_at, job.owner, parent=job,
                                 nbytes=job.nbytes // len(requests))
                          for part_request in requests)
        job.part_replies = {}
        job.state = JobState.RUNNING  # it runs as its parts
        return job.parts

    # ---- replies ---------------------------------------------------------------------

    def forward(self, job: Job, chunk: Any) -> None:
        """A chunk of a stream: to every requester still waiting."""
        job.chunks_sent += 1
        if job.history is not None:
            job.history.append(chunk)
        for req in job.live:
            if not req.sink.closed:
                req.sink.send(msgspec.structs.replace(chunk, id=req.client_id))

    def finish(self, job: Job, reply: Any) -> None:
        """The job's final reply, to each of its requesters under its own id (and a
        result under its model's key, whatever name the request used)."""
        if job.state is JobState.DONE:
            return
        if job.parent is not None:
            self._part_done(job, reply)
            return
        self._close(job)
        replace, failed = msgspec.structs.replace, type(reply) is Error
        for req in job.live:
            self._end(req, replace(reply, id=req.client_id) if failed
                      else replace(reply, id=req.client_id, model=job.model_key))

    def fail(self, job: Job, code: ErrorCode, message: str) -> None:
        self.finish(job, Error(id=0, code=code, message=message))

    def end_requester(self, req: Requester, reply: Any) -> None:
        """One requester is done (cancelled, timed out, gone); the job goes on while any
        other requester still waits for it."""
        if req.done:
            return
        job = req.job
        self._end(req, reply)
        if job is not None and job.state is not JobState.DONE and not job.live:
            self.events.abandon(job)
            self._close(job)

    def expire(self, req: Requester, due_at: float) -> None:
        job = req.job
        assert job is not None
        waited = self.scheduler.now() - req.accepted_at
        cause = self.events.wait_cause(job)
        if due_at == req.deadline_at:
            code, what = ErrorCode.DEADLINE_EXPIRED, f"deadline passed after {waited:.1f}s"
        else:
            code, what = ErrorCode.TIMEOUT, f"no reply within {waited:.1f}s"
        self.end_requester(req, Error(id=req.client_id, code=code,
                                      message=f"model {job.model_key!r}: {what} ({cause})"))

    def cancel(self, sink: ReplySink, client_id: int) -> None:
        req = sink.jobs.get(client_id)
        if req is not None:  # else already finished: its final reply is sent
            self.end_requester(req, Error(id=client_id, code=ErrorCode.CANCELLED,
                                          message=f"request {client_id} cancelled"))

    def forget_sink(self, sink: ReplySink) -> None:
        for req in list(sink.jobs.values()):
            self.end_requester(req, None)

    def _part_done(self, part: Job, reply: Any) -> None:
        parent = part.parent
        assert parent is not None
        self._close(part)
        if isinstance(reply, Error):
            self.finish(parent, reply)  # one failed part fails the request
            return
        assert parent.part_replies is not None
        parent.part_replies[part.job_id] = reply
        if len(parent.part_replies) == len(parent.parts):
            self.finish(parent, merge_rows([parent.part_replies[p.job_id]
                                            for p in parent.parts]))

    def _close(self, job: Job) -> None:
        for part in job.parts:  # a finished or abandoned request needs none of its parts
            if part.state is not JobState.DONE:
                self.events.abandon(part)
                self._close(part)
        was_queued = job.state is JobState.QUEUED
        job.state = JobState.DONE
        if job.dedup_key is not None and self.index.get(job.dedup_key) is job:
            del self.index[job.dedup_key]
        self.events.job_closed(job, was_queued)

    def _end(self, req: Requester, reply: Any) -> None:
        req.done = True  # no longer expires
        if req.sink.jobs.get(req.client_id) is req:
            del req.sink.jobs[req.client_id]
        if reply is not None and not req.sink.closed:
            req.sink.send(reply)
        self.events.request_ended(req, reply)
        # The requester and its job point at each other: unlinked, both are freed as their
        # last reference goes, not left as cycles for the garbage collector, which ran for
        # ~10% of the supervisor's time per no-op request.
        req.job = None


def dedup_key(kind: Kind, request: WorkRequest, model_key: str,
              digest_over: int = 0) -> bytes | None:
    """Identical work for identical inputs, or None when running it twice could differ
    (sampling without a seed) or the input is too large to be worth hashing. The key is
    the request as its work encodes (no id, priority or timing), or a 16-byte digest of
    it over digest_over bytes: the job book keys its index on the small ones as they are
    (a digest took ~1 us, of the ~40 a no-op request costs), the shared queue on digests."""
    if not kind.deterministic(request):
        return None
    neutral = msgspec.structs.replace(request, id=0, model=model_key, priority="normal",
                                      timeout_s=None, deadline_s=None, sent_at=None,
                                      tenant="")
    payload = encoder.encode(neutral)
    if len(payload) > DEDUP_MAX_BYTES:
        return None
    if DIGEST_BYTES < len(payload) <= digest_over:  # (never mistaken for a digest)
        return payload
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()
