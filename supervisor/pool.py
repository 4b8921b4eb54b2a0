"""The pool: admission, per-model queues, dispatch to workers, routing of replies.

Everything here runs on the supervisor's one event loop and is the only code that
mutates pool state. It knows capabilities (batched or streaming) and memory figures,
nothing of model families, their text processing or weight formats.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from modelpool.protocol import pipes
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import (
    Chunk,
    Describe,
    Embed,
    Embeddings,
    EmbedImage,
    End,
    Error,
    Generate,
    GenerateImage,
    Image,
    ImageProgress,
    WorkRequest,
)
from modelpool.protocol.pipes import Abort, FromWorker, Heartbeat, LoadFailed, Ready, WantWork, Work
from modelpool.registry.spec import ModelSpec, Registry
from modelpool.supervisor import admission, recovery, scaling
from modelpool.supervisor.admission import Rejection
from modelpool.supervisor.capacity import Capacity
from modelpool.supervisor.config import Config
from modelpool.supervisor.gpus import Gpu, resolve_device
from modelpool.supervisor.jobs import JobBook
from modelpool.supervisor.metrics import ModelMetrics
from modelpool.supervisor.queueing import (
    PRIORITY_RANK,
    Job,
    JobQueue,
    JobState,
    aged_rank,
    dedup_key,
)
from modelpool.supervisor.shm import SharedImages, weights_segment
from modelpool.supervisor.workers import Launcher, WorkerHandle, WorkerState
from modelpool.workers.main import WorkerSettings

# Which models may serve a request: an image-embedding model with a text tower
# also answers text embeddings, in the same space as its images.
SERVED_BY: dict[type, tuple[str, ...]] = {
    Embed: ("text_embedding", "image_embedding"),
    Generate: ("text_to_text",),
    EmbedImage: ("image_embedding",),
    Describe: ("vision",),
    GenerateImage: ("text_to_image",),
}
STREAMED = (Chunk, ImageProgress)
FINAL = (Embeddings, End, Image, Error)


@dataclass(eq=False)
class ModelState:
    spec: ModelSpec
    queue: JobQueue = field(default_factory=JobQueue)
    workers: dict[int, WorkerHandle] = field(default_factory=dict)
    metrics: ModelMetrics = field(default_factory=ModelMetrics)
    last_active: float = 0.0
    last_scale_down: float = 0.0
    load_failures: int = 0
    blocked_until: float = 0.0
    last_error: str | None = None
    last_failure_at: float | None = None
    measured_weights_mb: float | None = None  # file-backed weights, reported at Ready
    measured_per_worker_mb: float | None = None  # largest private memory (USS) seen
    waiting_for_memory: bool = False
    warm_target: int = 0  # workers kept up without traffic, set by `modelpool load`
    device: str | None = None  # "cpu" or "cuda:N"; None: this machine lacks the asked one
    batch_timer: asyncio.TimerHandle | None = None
    batch_waited: bool = False
    holder: WorkerHandle | None = None  # the weights holder, when the model uses one
    shared_weights: pipes.SharedWeights | None = None  # what the holder shares once loaded

    @property
    def uses_holder(self) -> bool:
        setting = self.spec.weights_holder
        return setting == "on" or (setting == "auto" and (self.device or "").startswith("cuda"))

    def processes(self) -> list[WorkerHandle]:
        """Its serving workers and its weights holder."""
        return [*self.workers.values(), *([self.holder] if self.holder else [])]

    def live_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values()
                if w.state not in (WorkerState.STOPPING, WorkerState.DEAD)]

    def running(self) -> int:
        return sum(len(w.jobs) for w in self.workers.values())


class Pool:
    def __init__(self, config: Config, registry: Registry, launcher: Launcher,
                 clock: Callable[[], float] = time.monotonic,
                 gpus: list[Gpu] | None = None) -> None:
        self.config = config
        self.pool_config = config.pool
        self.registry = registry
        self.launcher = launcher
        self.clock = clock
        self.gpus = gpus or []
        self.models = {key: ModelState(spec, device=resolve_device(spec.device, self.gpus))
                       for key, spec in registry.specs.items()}
        self.capacity = Capacity(self.models, config.pool, launcher, self.gpus)
        self.policy = scaling.ScalingPolicy(config.pool.cold_start_workers,
                                            config.pool.cooldown_idle_s)
        self.book = JobBook(self)
        self.shared = SharedImages()
        self.shutting_down = False
        self._worker_ids = itertools.count(1)
        self.changed = asyncio.Event()  # set whenever a request ends (the drain waits on it)

    # ---- admission -------------------------------------------------------------------

    def submit(self, sink: Any, request: WorkRequest, nbytes: int = 0) -> None:
        spec = self._resolve(request)
        model = self.models[spec.key] if spec else None
        deadline_in = self._deadline_in(request)
        reject = self._admission_error(sink, request, spec)
        if reject is None and deadline_in is not None and deadline_in <= 0:
            reject = ErrorCode.DEADLINE_EXPIRED, "the deadline passed before the daemon got it"
        key = dedup_key(request, model.spec.key) if model and not reject else None
        leader = self.book.leader_for(key)
        if reject is None and leader is None and model is not None:
            reject = admission.bounds_error(self, model, nbytes)
        if reject is not None:
            self._reject(sink, request, model, reject)
            return
        assert model is not None
        timeout = request.timeout_s or model.spec.timeout_s or self.pool_config.timeout_s
        req = self.book.requester(sink, request, timeout, deadline_in)
        model.last_active = req.accepted_at
        if leader is not None:
            self.book.attach(req, leader, model)
            return
        job = self.book.new_job(req, request, model, key)
        job.nbytes = nbytes
        max_batch = model.spec.max_batch or self.pool_config.max_batch
        if model.spec.batched and job.size > max_batch:
            for part in self.book.split(job, max_batch):
                model.queue.push(part)
        else:
            model.queue.push(job)
        self.reconcile(model)

    def _reject(self, sink: Any, request: WorkRequest, model: ModelState | None,
                reject: Rejection) -> None:
        code, message = reject
        retry = admission.retry_after(model) if code in (ErrorCode.QUEUE_FULL,
                                                     ErrorCode.OVERLOADED) else None
        if model is not None:
            model.metrics.by_priority[request.priority].rejected[code.value] += 1
        sink.send(Error(id=request.id, code=code, message=message, retry_after_s=retry))

    def _deadline_in(self, request: WorkRequest) -> float | None:
        """Seconds left of the client's deadline, counted from when the client sent it."""
        if request.deadline_s is None:
            return None
        in_transit = max(0.0, time.time() - request.sent_at) if request.sent_at else 0.0
        return request.deadline_s - in_transit

    def _resolve(self, request: WorkRequest) -> ModelSpec | None:
        if request.model:
            return self.registry.resolve(request.model)
        key = self.registry.defaults.get(SERVED_BY[type(request)][0])
        return self.registry.specs.get(key) if key else None

    def _admission_error(self, sink: Any, request: WorkRequest,
                         spec: ModelSpec | None) -> Rejection | None:
        if request.id in sink.jobs:
            return ErrorCode.BAD_REQUEST, f"request id {request.id} is already in flight"
        if self.shutting_down:
            return ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"
        served_by = SERVED_BY[type(request)]
        if spec is None:
            name = request.model or f"(default {served_by[0]} model)"
            return ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; see `modelpool models`"
        if spec.capability not in served_by:
            return (ErrorCode.WRONG_CAPABILITY,
                    f"model {spec.key!r} is {spec.capability}, not {served_by[0]}")
        if isinstance(request, Generate) and not (request.prompt or request.messages):
            return ErrorCode.BAD_REQUEST, "generate needs a prompt or messages"
        return (admission.image_error(self.config, request)
                or admission.load_error(self, self.models[spec.key])
                or admission.memory_error(self, spec.key))

    # ---- requests that end early ---------------------------------------------------------

    def cancel(self, sink: Any, client_id: int) -> None:
        self.book.cancel(sink, client_id)

    def forget_sink(self, sink: Any) -> None:
        """The client went away: free its waiting work and stop its streams."""
        self.book.forget_sink(sink)

    def abandon(self, job: Job) -> None:
        """Nobody waits for this job any more: stop it if a worker is streaming it."""
        model = self.models[job.model_key]
        if job.state is JobState.RUNNING and model.spec.streaming:
            worker = model.workers.get(job.worker_id or 0)
            if worker is not None:
                worker.send(Abort(job_id=job.job_id))

    def wait_cause(self, job: Job) -> str:
        """Why a job has not finished yet, for TIMEOUT and DEADLINE_EXPIRED messages."""
        model = self.models[job.model_key]
        if job.parts:
            done = len(job.part_replies)
            return f"split into {len(job.parts)} parts, {done} done"
        if job.state is JobState.RUNNING:
            worker = model.workers.get(job.worker_id or 0)
            return f"running on worker pid {worker.pid if worker else '?'}"
        if not model.workers:
            return "waiting for memory" if model.waiting_for_memory else "waiting for a worker"
        if not any(w.ready for w in model.workers.values()):
            return "the model was still loading"
        return f"waiting in a queue of {len(model.queue)}"

    # ---- worker messages ---------------------------------------------------------------

    def on_worker_message(self, worker: WorkerHandle, msg: FromWorker) -> None:
        model = self.models[worker.model_key]
        if isinstance(msg, STREAMED):
            job = worker.jobs.get(msg.id)
            if job is not None and job.state is JobState.RUNNING:
                self.book.forward(job, msg)
        elif isinstance(msg, FINAL):
            job = worker.jobs.pop(msg.id, None)
            self.shared.release(msg.id)
            if job is not None:
                if job.started_at is not None:
                    model.metrics.ran(self.clock() - job.started_at)
                reply = msg if isinstance(msg, Error) else msgspec.structs.replace(
                    msg, model=job.model_key)
                self.book.finish(job, reply)
        elif isinstance(msg, WantWork):
            worker.wants_work = True
            was_loading = worker.state is WorkerState.LOADING
            if worker.state in (WorkerState.BUSY, WorkerState.LOADING):
                worker.state = WorkerState.IDLE
            self.reconcile(model)
            if was_loading or any(m.waiting_for_memory for m in self.models.values()):
                self._reconcile_waiting()  # a load slot freed, or an evictable worker
        elif isinstance(msg, Ready):
            recovery.on_ready(self, model, worker, msg)
            if worker.state is WorkerState.HOLDING:
                self._reconcile_waiting()  # its workers can start, and a load slot is free
        elif isinstance(msg, LoadFailed):
            worker.load_error = msg.cause

    def on_heartbeat(self, worker: WorkerHandle, beat: Heartbeat) -> None:
        recovery.on_heartbeat(self, worker, beat)

    def check_health(self) -> None:
        recovery.check_health(self)

    def on_worker_exit(self, worker: WorkerHandle, exitcode: int | None) -> None:
        recovery.on_exit(self, worker, exitcode)
        self._reconcile_waiting()  # its memory and maybe its load slot are free again

    # ---- scaling and dispatch ----------------------------------------------------------

    def reconcile(self, model: ModelState) -> None:
        """Hand waiting work to free workers, then start workers the policy asks for."""
        self._dispatch(model)
        if not len(model.queue) and model.warm_target == 0:
            return  # nothing waits and nothing is pinned: no reason to start a worker
        view, now = self.capacity.load_view(model), self.clock()
        if self.shutting_down or not scaling.workers_to_start(view, self.policy, now, 1 << 16):
            return  # the common case; skip reading /proc/meminfo on every request
        count = scaling.workers_to_start(view, self.policy, now, self.capacity.room(model))
        holding = model.holder is not None and model.holder.state is WorkerState.HOLDING
        if count and model.uses_holder and not holding:
            if model.holder is None:
                self.start_worker(model, holder=True)
            return  # workers start once a holder shares weights (not one that is stopping)
        for _ in range(count):
            self.start_worker(model)

    def _reconcile_waiting(self) -> None:
        for model in self.models.values():
            if len(model.queue) or len(model.live_workers()) < model.warm_target:
                self.reconcile(model)

    def age_queues(self) -> None:
        """Raise the priority of work that has waited long (see queueing.aged_rank)."""
        now, every = self.clock(), self.pool_config.priority_aging_s
        for model in self.models.values():
            for job in model.queue.jobs():
                base = PRIORITY_RANK[job.request.priority]
                model.queue.promote(job, aged_rank(base, now - job.accepted_at, every))

    def _dispatch(self, model: ModelState) -> None:
        if not len(model.queue):
            return
        free = [w for w in model.workers.values()
                if w.wants_work and w.state is WorkerState.IDLE and not w.hung]
        free.sort(key=lambda w: w.last_used, reverse=True)  # keep the LRU ones idle to retire
        max_batch = model.spec.max_batch or self.pool_config.max_batch
        for worker in free:
            if not len(model.queue) or self._wait_for_batch(model, max_batch):
                return
            batch = self._runnable(model.queue.pop_batch(max_batch, model.spec.batched))
            if not batch:
                continue
            now = self.clock()
            for job in batch:
                job.state, job.worker_id, job.started_at = JobState.RUNNING, worker.worker_id, now
                worker.jobs[job.job_id] = job
            worker.wants_work, worker.state, worker.last_used = False, WorkerState.BUSY, now
            worker.last_dispatch_at = now
            model.metrics.batch(sum(job.size for job in batch))
            worker.send(Work(items=[self.shared.work_item(j.job_id, j.request) for j in batch]))

    def _runnable(self, jobs: list[Job]) -> list[Job]:
        """Drop what expired while waiting: expired work never reaches a worker."""
        now = self.clock()
        runnable = []
        for job in jobs:
            requesters = (job.parent or job).requesters
            for req in requesters:
                if not req.done and req.deadline_at is not None and req.deadline_at <= now:
                    self.book.expire(req, deadline=True)
            if any(not req.done for req in requesters):
                runnable.append(job)
        return runnable

    def _wait_for_batch(self, model: ModelState, max_batch: int) -> bool:
        """Under load, give a small batch max_batch_wait_ms to fill before it runs.
        An idle model never waits: a lone request should not pay for batching."""
        wait_s = self.pool_config.max_batch_wait_ms / 1000
        if not model.spec.batched or wait_s <= 0 or model.batch_waited:
            return False
        if model.batch_timer is not None:
            return True
        busy = any(w.state is WorkerState.BUSY for w in model.workers.values())
        if not busy or len(model.queue) >= max_batch:
            return False
        model.batch_timer = asyncio.get_running_loop().call_later(
            wait_s, self._batch_wait_over, model)
        return True

    def _batch_wait_over(self, model: ModelState) -> None:
        model.batch_timer, model.batch_waited = None, True
        try:
            self._dispatch(model)
        finally:
            model.batch_waited = False

    def start_worker(self, model: ModelState, holder: bool = False) -> WorkerHandle:
        worker = WorkerHandle(worker_id=next(self._worker_ids), model_key=model.spec.key,
                              started_at=self.clock())
        if holder:
            model.holder = worker
        else:
            model.workers[worker.worker_id] = worker
        settings = WorkerSettings(
            hold_segment=weights_segment(worker.worker_id) if holder else None,
            weights=None if holder else model.shared_weights,
            worker_id=worker.worker_id,
            spec=msgspec.structs.replace(model.spec, device=model.device or "cpu"),
            threads=self.capacity.cpu_plan(model)[0],
            max_batch=model.spec.max_batch or self.pool_config.max_batch,
            heartbeat_interval_s=self.pool_config.heartbeat_interval_s,
            images=self.config.images)
        asyncio.get_running_loop().create_task(self._launch(model, worker, settings))
        return worker

    async def _launch(self, model: ModelState, worker: WorkerHandle,
                      settings: WorkerSettings) -> None:
        try:
            await self.launcher.start(worker, settings)
        except Exception as exc:
            worker.state, worker.load_error = WorkerState.DEAD, f"worker start failed: {exc}"
            self.on_worker_exit(worker, None)
            return
        worker.spawned_at = self.clock()
        if worker.state is WorkerState.STOPPING:  # stopped while it was being created
            self.launcher.kill(worker)
        elif worker.state is WorkerState.STARTING:
            worker.state = WorkerState.LOADING

    def active_jobs(self) -> list[Job]:
        """Every accepted job still owed a final reply."""
        jobs: list[Job] = []
        for model in self.models.values():
            jobs.extend(model.queue.jobs())
            for worker in model.workers.values():
                jobs.extend(j for j in worker.jobs.values() if j.state is not JobState.DONE)
        return jobs
