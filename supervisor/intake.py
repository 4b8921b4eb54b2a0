"""Admission into the pool: whether a request may be queued, and queueing it: joined to
an identical one already waiting or running, or split into parts when it is a batched
request over max_batch. Refusals are answered at once with a typed error.

A component of the Pool: it queues into the pool's models and calls back
`queued(model, was_waiting)` so the pool dispatches and scales; it decides nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.kinds import KIND_OF, Kind, with_defaults
from modelpool.protocol.messages import Error, WorkRequest
from modelpool.registry.sources import Missing
from modelpool.registry.spec import ModelSpec, Registry
from modelpool.supervisor import admission
from modelpool.supervisor.admission import Rejection, RemoteModel
from modelpool.supervisor.capacity import Capacity
from modelpool.supervisor.clock import Scheduler
from modelpool.supervisor.config import Config
from modelpool.supervisor.jobs import JobBook
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.owners import owner_of
from modelpool.supervisor.queueing import PRIORITY_RANK, Job


class Intake:
    def __init__(self, config: Callable[[], Config], registry: Registry,
                 models: dict[str, ModelState],
                 capacity: Capacity, book: JobBook, scheduler: Scheduler, gpu_count: int,
                 closed: Callable[[], bool],
                 queued: Callable[[ModelState, bool], None]) -> None:
        self.config = config  # the pool's, as the last reload left it
        self.registry = registry
        self.models = models
        self.capacity = capacity
        self.book = book
        self.scheduler = scheduler
        self.gpu_count = gpu_count
        self.closed = closed  # the daemon is shutting down
        self.queued = queued
        # Are a cold model's files there? The server plugs in registry.sources'
        # missing_files; without it (tests of the pool with fake paths) nothing is missing.
        self.missing_files: Callable[[ModelSpec], Missing | None] = lambda spec: None

    def submit(self, sink: Any, request: WorkRequest, nbytes: int = 0) -> bool:
        """Queue the request for the sink (a connection, or a submitted job's mailbox
        entry), which gets its replies; or answer it with the reason it cannot be
        (False)."""
        kind, spec, model, request, deadline_in = self._prepare(request)
        reject: Rejection | None = None
        if request.id in sink.jobs:
            reject = ErrorCode.BAD_REQUEST, f"request id {request.id} is already in flight"
        reject = reject or self._static_refusal(kind, request, spec, deadline_in)
        key = self.book.key_for(kind, request, spec.key) if spec and not reject else None
        leader = self.book.leader_for(key)
        owner = owner_of(sink.owner, request.tenant)
        if reject is None and leader is None and model is not None:
            reject = admission.bounds_error(model, nbytes, self.config().pool, owner)
        if reject is not None:
            sink.send(self._error(request, model, reject))
            return False
        assert model is not None
        timeout = request.timeout_s or model.settings.timeout_s
        req = self.book.requester(sink, request, timeout, deadline_in)
        model.last_active = req.accepted_at
        if leader is not None:
            self.book.attach(req, leader)
            model.metrics.by_priority[req.priority].deduplicated += 1
            model.queue.promote(leader, PRIORITY_RANK[req.priority])
            return True
        self._queue(model, self.book.new_job(req, kind, request, model.key, key, owner),
                    nbytes)
        return True

    def refusal(self, request: WorkRequest,
                runs_elsewhere: Callable[[str], bool] | None = None,
                remote: RemoteModel | None = None) -> Error | None:
        """What submit would refuse this request with whatever the queues hold (unknown
        model, bad field, failed model, ...); nothing is queued. Jobs, which wait in
        their own queue, are refused with these; in a cluster, not for what keeps only
        this daemon from running the model when another can (runs_elsewhere), and a
        model only another node names (remote) is checked against what it says."""
        kind, spec, model, request, deadline_in = self._prepare(request)
        here = spec is not None and (runs_elsewhere is None or not runs_elsewhere(spec.key))
        reject = self._static_refusal(kind, request, spec or remote, deadline_in, here)
        return self._error(request, model, reject) if reject else None

    def _prepare(self, request: WorkRequest) -> tuple[Kind, ModelSpec | None,
                                                      ModelState | None, WorkRequest,
                                                      float | None]:
        kind = KIND_OF[type(request)]
        spec = admission.resolve(self.registry, kind, request)
        model = self.models[spec.key] if spec else None
        request = self.with_defaults(request, model)
        deadline_in = admission.deadline_in(request, self.scheduler.wall())
        return kind, spec, model, request, deadline_in

    def with_defaults(self, request: WorkRequest, model: ModelState | None) -> WorkRequest:
        """The request with what it leaves unset filled in: the model's recommendation,
        else the daemon's default."""
        defaults = self.config().defaults
        return with_defaults(request, model.request_defaults(defaults) if model else defaults)

    def _static_refusal(self, kind: Kind, request: WorkRequest,
                        spec: ModelSpec | RemoteModel | None, deadline_in: float | None,
                        here: bool = True) -> Rejection | None:
        if self.closed():
            return ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"
        reject = admission.request_error(kind, request, spec, self.config().images)
        if reject is not None or spec is None:
            return reject
        if here:
            reject = self.local_refusal(self.models[spec.key])
        if reject is None and deadline_in is not None and deadline_in <= 0:
            reject = ErrorCode.DEADLINE_EXPIRED, "the deadline passed before the daemon got it"
        return reject

    def local_refusal(self, model: ModelState) -> Rejection | None:
        """Why this daemon cannot run the model now, whatever the request: no such
        device here, failed or backing off, never fits the budget, files not here."""
        if model.device is not None and not model.failed and model.has_live_worker():
            # A live worker passes the rest (it backs off, fits and has its files):
            # most requests, so their three checks are skipped (~3% of a no-op's cost).
            return None
        return (admission.load_error(model, self.scheduler.now(), self.gpu_count)
                or admission.memory_error(model, self.capacity.budget_for)
                or self._files_error(model))

    def _files_error(self, model: ModelState) -> Rejection | None:
        """A model with no worker whose files are not there fails at once, saying what
        to do (a path to fix, `modelpool pull` to run), instead of after a load or a
        download the request would time out waiting for."""
        if model.has_live_worker():
            return None
        missing = self.missing_files(model.spec)
        return (ErrorCode.MODEL_LOAD_FAILED, missing.message) if missing else None

    def _queue(self, model: ModelState, job: Job, nbytes: int) -> None:
        job.nbytes = nbytes
        was_waiting = len(model.queue) > 0
        if job.kind.batched and job.size > model.settings.max_batch:
            for part in self.book.split(job, model.settings.max_batch):
                model.queue.push(part)
        else:
            model.queue.push(job)
        self.queued(model, was_waiting)

    def _error(self, request: WorkRequest, model: ModelState | None,
               reject: Rejection) -> Error:
        code, message = reject
        retry = admission.retry_after(model) if code in (ErrorCode.QUEUE_FULL,
                                                         ErrorCode.OVERLOADED) else None
        if model is not None:
            model.metrics.rejected(KIND_OF[type(request)].op, request.priority, code)
        return Error(id=request.id, code=code, message=message, retry_after_s=retry)
