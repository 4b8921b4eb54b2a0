"""The requesters of every job: their timers, their one final reply each, the fan-out of
a deduplicated job's replies, and the per-priority metrics of how requests ended."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embed, Error, WorkRequest
from modelpool.supervisor.metrics import ModelMetrics
from modelpool.supervisor.queueing import (
    PRIORITY_RANK,
    Job,
    JobState,
    ReplySink,
    Requester,
)

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelState, Pool

STREAMING_REQUESTS = ("Generate", "Describe", "GenerateImage")


class JobBook:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.index: dict[bytes, Job] = {}  # dedup: key -> the job doing that work
        self._job_ids = itertools.count(1)

    # ---- admission -------------------------------------------------------------------

    def leader_for(self, key: bytes | None) -> Job | None:
        """The job already doing this work (same dedup key), if any."""
        job = self.index.get(key) if key else None
        return job if job is not None and job.state is not JobState.DONE else None

    def requester(self, sink: ReplySink, request: WorkRequest, timeout_s: float,
                  deadline_in_s: float | None) -> Requester:
        """Register the client's request and arm its timer (timeout or deadline)."""
        now = self.pool.clock()
        req = Requester(sink, request.id, request.priority, now,
                        None if deadline_in_s is None else now + deadline_in_s)
        sink.jobs[request.id] = req
        is_deadline = deadline_in_s is not None and deadline_in_s < timeout_s
        delay = deadline_in_s if is_deadline else timeout_s
        req.timer = asyncio.get_running_loop().call_later(delay, self.expire, req, is_deadline)
        return req

    def attach(self, req: Requester, leader: Job, model: ModelState) -> None:
        """An identical request is already waiting or running: share its result."""
        leader.requesters.append(req)
        req.job = leader
        model.metrics.by_priority[req.priority].deduplicated += 1
        model.queue.promote(leader, PRIORITY_RANK[req.priority])
        for chunk in leader.history or []:  # a stream already under way: replay it
            req.sink.send(msgspec.structs.replace(chunk, id=req.client_id))

    def new_job(self, req: Requester, request: WorkRequest, model: ModelState,
                key: bytes | None) -> Job:
        streaming = type(request).__name__ in STREAMING_REQUESTS
        job = Job(job_id=next(self._job_ids), request=request, model_key=model.spec.key,
                  accepted_at=req.accepted_at, requesters=[req], dedup_key=key,
                  history=[] if key and streaming else None)
        req.job = job
        if key:
            self.index[key] = job
        return job

    # ---- replies ---------------------------------------------------------------------

    def forward(self, job: Job, chunk: Any) -> None:
        """A chunk of a stream: to every requester still waiting."""
        job.chunks_sent += 1
        if job.history is not None:
            job.history.append(chunk)
        for req in job.live:
            if not req.sink.closed:
                req.sink.send(msgspec.structs.replace(chunk, id=req.client_id))

    def split(self, job: Job, max_batch: int) -> list[Job]:
        """Parts of at most max_batch inputs, so one huge request is spread over workers
        and interleaves with other work instead of holding a worker for its whole length."""
        request = job.request
        field_name = "texts" if isinstance(request, Embed) else "images"
        items = getattr(request, field_name)
        for start in range(0, len(items), max_batch):
            part_request = msgspec.structs.replace(
                request, **{field_name: items[start : start + max_batch]})
            job.parts.append(Job(job_id=next(self._job_ids), request=part_request,
                                 model_key=job.model_key, accepted_at=job.accepted_at,
                                 parent=job, nbytes=job.nbytes * max_batch // len(items)))
        job.state = JobState.RUNNING  # it runs as its parts
        return job.parts

    def finish(self, job: Job, reply: Any) -> None:
        """The job's final reply, to each of its requesters under its own id."""
        if job.state is JobState.DONE:
            return
        if job.parent is not None:
            self._part_done(job, reply)
            return
        self._close(job)
        for req in job.live:
            self._end(req, msgspec.structs.replace(reply, id=req.client_id))

    def fail(self, job: Job, code: ErrorCode, message: str) -> None:
        self.finish(job, Error(id=0, code=code, message=message))

    def end_requester(self, req: Requester, reply: Any) -> None:
        """One requester is done (cancelled, timed out, gone); the job goes on while any
        other requester still waits for it."""
        if req.done:
            return
        self._end(req, reply)
        job = req.job
        if job is not None and job.state is not JobState.DONE and not job.live:
            self.pool.abandon(job)
            self._close(job)

    def expire(self, req: Requester, deadline: bool) -> None:
        job = req.job
        assert job is not None
        waited = self.pool.clock() - req.accepted_at
        cause = self.pool.wait_cause(job)
        if deadline:
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
        parent.part_replies[part.job_id] = reply
        if len(parent.part_replies) == len(parent.parts):
            rows = [parent.part_replies[p.job_id] for p in parent.parts]
            self.finish(parent, msgspec.structs.replace(
                rows[0], data=b"".join(r.data for r in rows),
                shape=[sum(r.shape[0] for r in rows), *rows[0].shape[1:]]))

    def _close(self, job: Job) -> None:
        for part in job.parts:  # a finished or abandoned request needs none of its parts
            if part.state is not JobState.DONE:
                self.pool.abandon(part)
                self._close(part)
        model = self.pool.models[job.model_key]
        if job.state is JobState.QUEUED:
            job.state = JobState.DONE
            model.queue.discard(job)
        job.state = JobState.DONE
        if job.dedup_key is not None and self.index.get(job.dedup_key) is job:
            del self.index[job.dedup_key]
        model.last_active = self.pool.clock()

    def _end(self, req: Requester, reply: Any) -> None:
        req.done = True
        if req.timer is not None:
            req.timer.cancel()
        if req.sink.jobs.get(req.client_id) is req:
            del req.sink.jobs[req.client_id]
        if req.job is not None:
            self._count(self.pool.models[req.job.model_key].metrics, req, reply)
        if reply is not None and not req.sink.closed:
            req.sink.send(reply)
        self.pool.changed.set()

    def _count(self, metrics: ModelMetrics, req: Requester, reply: Any) -> None:
        counters = metrics.by_priority[req.priority]
        if reply is None:
            return  # the client left: nobody to count it for
        if not isinstance(reply, Error):
            counters.completed += 1
            counters.latencies_s.append(self.pool.clock() - req.accepted_at)
        elif reply.code is ErrorCode.DEADLINE_EXPIRED:
            counters.expired += 1
        else:
            counters.failed += 1
