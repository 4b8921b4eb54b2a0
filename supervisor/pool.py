"""The pool: admission, per-model queues, dispatch to workers, replies, recovery.

Everything here runs on the supervisor's one event loop and is the only code that
mutates pool state. It knows capabilities (batched or streaming) and memory figures,
never model families, tokenizers or weight formats.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import Chunk, Embed, Embeddings, End, Error, Generate
from protocol.pipes import (
    Abort,
    FromWorker,
    Heartbeat,
    LoadFailed,
    Ready,
    WantWork,
    Work,
    WorkItem,
)
from registry.spec import ModelSpec, Registry
from supervisor import health, memory, scaling
from supervisor.capacity import Capacity
from supervisor.config import Config
from supervisor.queueing import Job, JobQueue, JobState
from supervisor.workers import Launcher, WorkerHandle, WorkerState
from workers import exitcodes
from workers.main import WorkerSettings

log = logging.getLogger("modelpool.pool")

HUNG_KILL_GRACE_S = 1.0  # SIGTERM first so a worker can flush its logs; then SIGKILL

CAPABILITY_OF = {Embed: "text_embedding", Generate: "text_to_text"}


@dataclass(eq=False)
class ModelState:
    spec: ModelSpec
    queue: JobQueue = field(default_factory=JobQueue)
    workers: dict[int, WorkerHandle] = field(default_factory=dict)
    last_active: float = 0.0
    last_scale_down: float = 0.0
    load_failures: int = 0
    blocked_until: float = 0.0
    last_error: str | None = None
    measured_weights_mb: float | None = None  # file-backed weights, reported at Ready
    measured_per_worker_mb: float | None = None  # largest private memory (USS) seen
    waiting_for_memory: bool = False
    last_failure_at: float | None = None
    warm_target: int = 0  # workers kept up without traffic, set by `modelpool load`
    completed: int = 0
    failed: int = 0

    def live_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values()
                if w.state not in (WorkerState.STOPPING, WorkerState.DEAD)]

    def running(self) -> int:
        return sum(len(w.jobs) for w in self.workers.values())


class Pool:
    def __init__(self, config: Config, registry: Registry, launcher: Launcher,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool_config = config.pool
        self.registry = registry
        self.launcher = launcher
        self.clock = clock
        self.models = {key: ModelState(spec) for key, spec in registry.specs.items()}
        self.capacity = Capacity(self.models, config.pool, launcher)
        self.policy = scaling.ScalingPolicy(config.pool.cold_start_workers,
                                            config.pool.cooldown_idle_s)
        self.shutting_down = False
        self._job_ids = itertools.count(1)
        self._worker_ids = itertools.count(1)
        self.changed = asyncio.Event()  # set whenever a job finishes (the drain waits on it)

    # ---- admission -------------------------------------------------------------------

    def submit(self, sink: Any, request: Embed | Generate) -> None:
        reject = self._admission_error(sink, request)
        if reject is not None:
            sink.send(Error(id=request.id, code=reject[0], message=reject[1]))
            return
        model = self.models[self._resolve(request).key]  # type: ignore[union-attr]
        now = self.clock()
        job = Job(job_id=next(self._job_ids), request=request, sink=sink,
                  model_key=model.spec.key, accepted_at=now)
        sink.jobs[request.id] = job
        timeout = request.timeout_s or model.spec.timeout_s or self.pool_config.timeout_s
        loop = asyncio.get_running_loop()
        if request.deadline_s is not None and request.deadline_s < timeout:
            job.timer = loop.call_later(request.deadline_s, self._expired, job, True)
        else:
            job.timer = loop.call_later(timeout, self._expired, job, False)
        model.queue.push(job)
        model.last_active = now
        self.reconcile(model)

    def _resolve(self, request: Embed | Generate) -> ModelSpec | None:
        if request.model:
            return self.registry.resolve(request.model)
        key = self.registry.defaults.get(CAPABILITY_OF[type(request)])
        return self.registry.specs.get(key) if key else None

    def _admission_error(self, sink: Any,
                         request: Embed | Generate) -> tuple[ErrorCode, str] | None:
        if request.id in sink.jobs:
            return ErrorCode.BAD_REQUEST, f"request id {request.id} is already in flight"
        if self.shutting_down:
            return ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"
        capability = CAPABILITY_OF[type(request)]
        spec = self._resolve(request)
        if spec is None:
            name = request.model or f"(default {capability} model)"
            return ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; see `modelpool models`"
        if spec.capability != capability:
            return (ErrorCode.WRONG_CAPABILITY,
                    f"model {spec.key!r} is {spec.capability}, not {capability}")
        if isinstance(request, Generate) and not (request.prompt or request.messages):
            return ErrorCode.BAD_REQUEST, "generate needs a prompt or messages"
        return self._load_error(self.models[spec.key]) or self._memory_error(spec.key)

    def _memory_error(self, key: str) -> tuple[ErrorCode, str] | None:
        charge = self.capacity.charge(self.models[key])
        if not memory.never_fits(charge, self.capacity.budget_mb):
            return None
        return (ErrorCode.INSUFFICIENT_MEMORY,
                f"model {key!r} needs ~{charge.weights_mb + charge.per_worker_mb:.0f} MiB "
                f"(weights {charge.weights_mb:.0f} + one worker {charge.per_worker_mb:.0f}); "
                f"the budget is {self.capacity.budget_mb:.0f} MiB (memory_fraction x RAM)")

    def _load_error(self, model: ModelState) -> tuple[ErrorCode, str] | None:
        key, now = model.spec.key, self.clock()
        if model.load_failures >= self.pool_config.max_load_failures:
            return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} failed to load "
                    f"{model.load_failures} times ({model.last_error}); "
                    f"`modelpool load {key}` retries")
        if now < model.blocked_until and not model.live_workers():
            return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} failed to load "
                    f"({model.last_error}); retrying in {model.blocked_until - now:.1f}s")
        return None

    # ---- finishing jobs ----------------------------------------------------------------

    def finish(self, job: Job, reply: Any) -> None:
        """Send a job's one final reply; later attempts to finish it are ignored."""
        if job.state is JobState.DONE:
            return
        model = self.models[job.model_key]
        if job.state is JobState.QUEUED:
            job.state = JobState.DONE
            model.queue.discard(job)
        job.state = JobState.DONE
        if job.timer is not None:
            job.timer.cancel()
        if job.sink.jobs.get(job.client_id) is job:
            del job.sink.jobs[job.client_id]
        if isinstance(reply, Error):
            model.failed += 1
        elif reply is not None:  # None: the client is gone, nobody to answer
            model.completed += 1
        model.last_active = self.clock()
        if reply is not None and not job.sink.closed:
            job.sink.send(reply)
        self.changed.set()

    def fail(self, job: Job, code: ErrorCode, message: str) -> None:
        self.finish(job, Error(id=job.client_id, code=code, message=message))

    def _expired(self, job: Job, deadline: bool) -> None:
        model = self.models[job.model_key]
        waited = self.clock() - job.accepted_at
        if job.state is JobState.RUNNING:
            worker = model.workers.get(job.worker_id or 0)
            cause = f"running on worker pid {worker.pid if worker else '?'}"
            self._abort_running(job)
        elif not model.workers:
            cause = ("waiting for memory" if model.waiting_for_memory
                     else "waiting for a load slot")
        elif not any(w.ready for w in model.workers.values()):
            cause = "the model was still loading"
        else:
            cause = f"waiting in a queue of {len(model.queue)}"
        if deadline:
            self.fail(job, ErrorCode.DEADLINE_EXPIRED,
                      f"model {job.model_key!r}: deadline passed after {waited:.1f}s ({cause})")
        else:
            self.fail(job, ErrorCode.TIMEOUT,
                      f"model {job.model_key!r}: no reply within {waited:.1f}s ({cause})")

    def cancel(self, sink: Any, client_id: int) -> None:
        job = sink.jobs.get(client_id)
        if job is None:
            return  # already finished: the final reply is on its way or sent
        self._abort_running(job)
        self.fail(job, ErrorCode.CANCELLED, f"request {client_id} cancelled by the client")

    def forget_sink(self, sink: Any) -> None:
        """The client went away: free its waiting work and stop its streams."""
        for job in list(sink.jobs.values()):
            self._abort_running(job)
            self.finish(job, None)

    def _abort_running(self, job: Job) -> None:
        if job.state is JobState.RUNNING and isinstance(job.request, Generate):
            worker = self.models[job.model_key].workers.get(job.worker_id or 0)
            if worker is not None:
                worker.send(Abort(job_id=job.job_id))

    # ---- worker messages ---------------------------------------------------------------

    def on_worker_message(self, worker: WorkerHandle, msg: FromWorker) -> None:
        model = self.models[worker.model_key]
        match msg:
            case Chunk():
                job = worker.jobs.get(msg.id)
                if job is not None and job.state is JobState.RUNNING and not job.sink.closed:
                    job.chunks_sent += 1
                    job.sink.send(msgspec.structs.replace(msg, id=job.client_id))
            case Embeddings() | End() | Error():
                job = worker.jobs.pop(msg.id, None)
                if job is not None:
                    self.finish(job, self._client_reply(job, msg))
            case WantWork():
                worker.wants_work = True
                was_loading = worker.state is WorkerState.LOADING
                if worker.state in (WorkerState.BUSY, WorkerState.LOADING):
                    worker.state = WorkerState.IDLE
                self.reconcile(model)
                if was_loading:
                    self._reconcile_waiting()  # a load slot just freed
            case Ready():
                self._on_ready(model, worker, msg)
            case LoadFailed(cause=cause):
                worker.load_error = cause

    def on_heartbeat(self, worker: WorkerHandle, beat: Heartbeat) -> None:
        now = self.clock()
        worker.last_heartbeat = now
        if beat.progress != worker.progress:
            worker.progress, worker.progress_changed_at = beat.progress, now

    def check_health(self) -> None:
        """Kill hung workers; their exit re-queues their work like any other death."""
        now = self.clock()
        for model in self.models.values():
            stall_s = model.spec.stall_timeout_s or self.pool_config.stall_timeout_s
            for worker in model.workers.values():
                if worker.hung or worker.state in (WorkerState.STARTING, WorkerState.DEAD):
                    continue
                pulse = health.WorkerPulse(
                    worker.started_at, worker.last_heartbeat,
                    max(worker.progress_changed_at, worker.last_dispatch_at), bool(worker.jobs))
                reason = health.hung_reason(pulse, now, self.pool_config.heartbeat_timeout_s,
                                            stall_s)
                if reason:
                    worker.hung = reason
                    log.warning("worker %d (pid %s) of %s is hung (%s): terminating it",
                                worker.worker_id, worker.pid, model.spec.key, reason)
                    self.launcher.terminate(worker, HUNG_KILL_GRACE_S)

    def _client_reply(self, job: Job, msg: Embeddings | End | Error) -> Any:
        if isinstance(msg, Error):
            return msgspec.structs.replace(msg, id=job.client_id)
        return msgspec.structs.replace(msg, id=job.client_id, model=job.model_key)

    def _on_ready(self, model: ModelState, worker: WorkerHandle, msg: Ready) -> None:
        worker.info, worker.load_s = msg.info, round(msg.load_s, 3)
        worker.last_used = worker.ready_at = self.clock()
        model.load_failures, model.blocked_until, model.last_error = 0, 0.0, None
        model.last_failure_at = None
        if msg.weights_mb is not None:
            model.measured_weights_mb = msg.weights_mb
        self.capacity.note_uss(model, worker, msg.uss_mb)
        log.info("worker %d of %s ready: pid %d, loaded in %.2fs, USS %.0f MiB",
                 worker.worker_id, model.spec.key, msg.pid, msg.load_s, msg.uss_mb or 0)

    def on_worker_exit(self, worker: WorkerHandle, exitcode: int | None) -> None:
        model = self.models[worker.model_key]
        model.workers.pop(worker.worker_id, None)
        expected = exitcode == exitcodes.OK and not worker.jobs
        level = logging.INFO if expected else logging.WARNING
        log.log(level, "worker %d (pid %s) of %s exited: %s", worker.worker_id, worker.pid,
                model.spec.key, exitcodes.describe(exitcode))
        if worker.ready_at is None and worker.load_error is None and exitcode != exitcodes.OK:
            worker.load_error = f"worker exited while loading: {exitcodes.describe(exitcode)}"
        if worker.load_error is not None:
            self._load_failed(model, worker, worker.load_error)
        for job in worker.jobs.values():
            self._recover(job, worker, exitcode)
        worker.jobs.clear()
        self.changed.set()
        self._reconcile_waiting()  # its memory and maybe its load slot are free again

    def _recover(self, job: Job, worker: WorkerHandle, exitcode: int | None) -> None:
        if job.state is JobState.DONE:
            return
        why = f"worker pid {worker.pid} of {job.model_key!r} died ({exitcodes.describe(exitcode)})"
        if job.chunks_sent > 0:
            self.fail(job, ErrorCode.WORKER_DIED, f"{why} after streaming {job.chunks_sent} chunks")
        elif job.retries >= 1:
            self.fail(job, ErrorCode.WORKER_DIED, f"{why}; the request was already retried once")
        else:
            job.retries += 1
            job.state, job.worker_id = JobState.QUEUED, None
            self.models[job.model_key].queue.push_front(job)

    def _load_failed(self, model: ModelState, worker: WorkerHandle, cause: str) -> None:
        now = self.clock()
        # Workers started together fail together: one attempt, one failure.
        if model.last_failure_at is None or worker.started_at > model.last_failure_at:
            model.last_failure_at = now
            model.load_failures += 1
            backoff = min(self.pool_config.load_backoff_s * 2 ** (model.load_failures - 1),
                          self.pool_config.load_backoff_max_s)
            model.blocked_until = now + backoff
        model.last_error = cause
        log.error("model %s failed to load (%d in a row): %s", model.spec.key,
                  model.load_failures, cause)
        if any(w.ready for w in model.workers.values()):
            return  # a sibling serves; the queue keeps waiting for it
        for job in model.queue.jobs():
            self.fail(job, ErrorCode.MODEL_LOAD_FAILED, f"model {model.spec.key!r}: {cause}")

    # ---- scaling and dispatch ----------------------------------------------------------

    def reconcile(self, model: ModelState) -> None:
        """Hand waiting work to free workers, then start workers the policy asks for."""
        self._dispatch(model)
        view, now = self.capacity.load_view(model), self.clock()
        if self.shutting_down or not scaling.workers_to_start(view, self.policy, now, 1 << 16):
            return  # the common case; skip reading /proc/meminfo on every request
        for _ in range(scaling.workers_to_start(view, self.policy, now, self.capacity.room(model))):
            self.start_worker(model)

    def _reconcile_waiting(self) -> None:
        for model in self.models.values():
            if len(model.queue) or len(model.live_workers()) < model.warm_target:
                self.reconcile(model)

    def _dispatch(self, model: ModelState) -> None:
        free = [w for w in model.workers.values()
                if w.wants_work and w.state is WorkerState.IDLE and not w.hung]
        free.sort(key=lambda w: w.last_used, reverse=True)  # keep the LRU ones idle to retire
        max_batch = model.spec.max_batch or self.pool_config.max_batch
        for worker in free:
            batch = model.queue.pop_batch(max_batch, model.spec.batched)
            if not batch:
                return
            now = self.clock()
            for job in batch:
                job.state, job.worker_id, job.started_at = JobState.RUNNING, worker.worker_id, now
                worker.jobs[job.job_id] = job
            worker.wants_work, worker.state, worker.last_used = False, WorkerState.BUSY, now
            worker.last_dispatch_at = now
            worker.send(Work(items=[WorkItem(job_id=j.job_id, request=j.request) for j in batch]))

    def start_worker(self, model: ModelState) -> WorkerHandle:
        worker = WorkerHandle(worker_id=next(self._worker_ids), model_key=model.spec.key,
                              started_at=self.clock())
        model.workers[worker.worker_id] = worker
        settings = WorkerSettings(
            worker_id=worker.worker_id, spec=model.spec,
            threads=self.capacity.cpu_plan(model)[0],
            max_batch=model.spec.max_batch or self.pool_config.max_batch,
            heartbeat_interval_s=self.pool_config.heartbeat_interval_s)
        asyncio.get_running_loop().create_task(self._launch(model, worker, settings))
        return worker

    async def _launch(self, model: ModelState, worker: WorkerHandle,
                      settings: WorkerSettings) -> None:
        try:
            await self.launcher.start(worker, settings)
        except Exception as exc:
            log.exception("could not start a worker for %s", model.spec.key)
            worker.state, worker.load_error = WorkerState.DEAD, f"worker start failed: {exc}"
            self.on_worker_exit(worker, None)
            return
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
