"""The pool: the one owner of the supervisor's state, on its one event loop.

It admits requests into per-model queues, reacts to each worker event in one `handle_*`
method, asks the scaling policy for a plan and applies it in `apply`, and starts and
stops workers. What a request kind is comes from the request-kind table; the pool knows
capabilities and memory figures, nothing of model families, their text processing or
weight formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Iterator
from typing import Any

from modelpool.protocol.kinds import STREAMED
from modelpool.protocol.messages import WorkRequest
from modelpool.protocol.pipes import (
    Abort,
    ExportFirst,
    FromWorker,
    Heartbeat,
    LoadFailed,
    Ready,
    Replies,
    WantWork,
    WorkerSettings,
)
from modelpool.registry.spec import ModelSpec, Registry
from modelpool.supervisor import capacity, exits, pressure, scaling, watch
from modelpool.supervisor.capacity import Capacity
from modelpool.supervisor.clock import Scheduler
from modelpool.supervisor.config import Config, PoolConfig
from modelpool.supervisor.dispatch import Dispatcher
from modelpool.supervisor.exports import Exports, run_export
from modelpool.supervisor.gpus import Gpu, resolve_device
from modelpool.supervisor.intake import Intake
from modelpool.supervisor.jobs import JobBook
from modelpool.supervisor.models import ModelSettings, ModelState
from modelpool.supervisor.queueing import Job, JobQueue, JobState, QueuedTotals, Requester
from modelpool.supervisor.shm import SharedImages
from modelpool.supervisor.threads import ThreadBudget
from modelpool.supervisor.workers import Launcher, WorkerHandle, WorkerState

log = logging.getLogger("modelpool.pool")


class Pool:
    def __init__(self, config: Config, registry: Registry, launcher: Launcher,
                 scheduler: Scheduler, gpus: list[Gpu] | None = None, cpus: int = 1) -> None:
        self.config = config
        self.registry = registry
        self.launcher = launcher
        self.scheduler = scheduler
        self.gpus = gpus or []
        self.cpus = cpus
        self.queued_totals = QueuedTotals()  # what every model's queue holds
        self.models = {key: self.model_state(spec) for key, spec in registry.specs.items()}
        self.capacity = Capacity(config.pool, self.gpus, lambda: self.exports.view())
        self.policy = scaling.ScalingPolicy(config.pool.cold_start_workers,
                                            config.pool.cooldown_idle_s)
        self.book = JobBook(scheduler, self)
        self.shared = SharedImages()
        self.exports = Exports(lambda: self.plan_export(),
                               functools.partial(run_export, launcher))
        self.dispatcher = Dispatcher(scheduler, self.book, self.shared,
                                     config.pool.max_batch_wait_ms / 1000,
                                     ThreadBudget(cpus, self.models))
        self.intake = Intake(lambda: self.config, registry, self.models, self.capacity,
                             self.book, scheduler, len(self.gpus),
                             lambda: self.shutting_down, self.queued)
        self.shutting_down = False
        self._worker_ids = itertools.count(1)
        self.changed = asyncio.Event()  # set whenever a request ends or a worker exits
        self.held: dict[str, ModelState] | None = None  # see admitting()
        self.oom = pressure.OomCounter()  # the server gives it the daemon's cgroup

    @property
    def pool_config(self) -> PoolConfig:
        return self.config.pool

    def follow_pool_config(self) -> None:
        """A reload's [pool] (already in self.config) from now on: budgets, scaling,
        batching and health limits (read where they are used); each model's settings
        are derived again by the reload (supervisor/reload.py), which knows what its
        workers started with."""
        config = self.pool_config
        self.capacity.follow_config(config)
        self.policy = scaling.ScalingPolicy(config.cold_start_workers, config.cooldown_idle_s)
        self.dispatcher.batch_wait_s = config.max_batch_wait_ms / 1000

    def model_state(self, spec: ModelSpec) -> ModelState:
        state = ModelState(spec, ModelSettings.of(spec, self.pool_config, self.cpus),
                           resolve_device(spec.device, self.gpus),
                           queue=JobQueue(self.queued_totals))
        state.read_recommended()
        return state

    # ---- requests ----------------------------------------------------------------------

    def submit(self, sink: Any, request: WorkRequest, nbytes: int = 0) -> bool:
        """Queue the request, or answer the sink why not (False)."""
        return self.intake.submit(sink, request, nbytes)

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Requests submitted within (a client's read) are all queued before any is
        dispatched: else the first went to a free worker alone, the rest after its reply."""
        if self.held is not None:
            yield
            return
        self.held = {}
        try:
            yield
        finally:
            held, self.held = self.held, None
            for model in held.values():
                try:
                    self.reconcile(model)
                except Exception:  # as handle_frame does: the daemon goes on
                    log.exception("internal error dispatching %s", model.key)

    def cancel(self, sink: Any, client_id: int) -> None:
        self.book.cancel(sink, client_id)

    def forget_sink(self, sink: Any) -> None:
        """The client went away: free its waiting work and stop its streams."""
        self.book.forget_sink(sink)

    # ---- what the job book reports (JobEvents) -------------------------------------------

    def abandon(self, job: Job) -> None:
        worker = self.models[job.model_key].workers.get(job.worker_id or 0)
        if job.state is JobState.RUNNING and job.kind.streaming and worker is not None:
            worker.send(Abort(job_id=job.job_id))

    def wait_cause(self, job: Job) -> str:
        return self.models[job.model_key].wait_cause(job)

    def job_closed(self, job: Job, was_queued: bool) -> None:
        model = self.models[job.model_key]
        if was_queued:
            model.queue.discard(job)
        model.last_active = self.scheduler.now()

    def request_ended(self, req: Requester, reply: Any) -> None:
        if req.job is not None:
            model = self.models[req.job.model_key]
            model.metrics.ended(req.job.kind.op, req.priority, reply,
                                self.scheduler.now() - req.accepted_at)
        self.changed.set()

    # ---- what workers report (WorkerEvents) ----------------------------------------------

    def handle(self, worker: WorkerHandle, msg: FromWorker) -> None:
        kind = type(msg)  # by exact type: isinstance of a msgspec type costs ~5x as much
        if kind is Replies:
            self.handle_replies(worker, msg.items)
        elif kind is WantWork:
            self.handle_want_work(worker, msg.slots)
        elif kind in STREAMED:
            self.handle_chunk(worker, msg)
        elif kind is Ready:
            self.handle_ready(worker, msg)
        elif kind is LoadFailed:
            worker.load_error = msg.cause  # its exit, which follows, is the load failure
        elif kind is ExportFirst:
            self.exports.handed_over(self.models[worker.model_key], worker, msg.entry,
                                     msg.model_dir)
        else:
            self.handle_replies(worker, [msg])

    def handle_want_work(self, worker: WorkerHandle, slots: int = 1) -> None:
        worker.slots += slots
        was_loading = worker.state is WorkerState.LOADING
        if was_loading:
            worker.move_to(WorkerState.IDLE)
        self._idle_if_free(worker)
        self.reconcile(self.models[worker.model_key])
        if was_loading or any(m.waiting_for_memory for m in self.models.values()):
            self.reconcile_waiting()  # a load slot freed, or an evictable worker

    @staticmethod
    def _idle_if_free(worker: WorkerHandle) -> None:
        """Busy no more: it runs nothing and has asked for work (a worker that batches
        streams asks for more while it still runs some: still busy)."""
        if worker.state is WorkerState.BUSY and not worker.jobs and worker.slots > 0:
            worker.move_to(WorkerState.IDLE)

    def handle_ready(self, worker: WorkerHandle, msg: Ready) -> None:
        model = self.models[worker.model_key]
        model.note_ready(worker, msg, self.scheduler.now())
        self.exports.note_ready(model, worker)
        if worker is not model.holder:
            log.info("worker %d of %s ready: pid %d, loaded in %.2fs, USS %.0f MiB",
                     worker.worker_id, model.key, msg.pid, msg.load_s, msg.uss_mb or 0)
            return  # it becomes idle when it asks for work
        log.info("weights holder of %s ready: pid %d, %.0f MiB shared, loaded in %.2fs",
                 model.key, msg.pid, model.measured_weights_mb or 0, msg.load_s)
        if worker.state is WorkerState.LOADING:
            worker.move_to(WorkerState.HOLDING)
            self.reconcile_waiting()  # its workers can start, and a load slot is free

    def handle_chunk(self, worker: WorkerHandle, msg: Any) -> None:
        job = worker.jobs.get(msg.id)
        if job is not None and job.state is JobState.RUNNING:
            self.book.forward(job, msg)

    def handle_replies(self, worker: WorkerHandle, replies: list[Any]) -> None:
        """Final replies, in the order sent; a batch's run time counts once, as one dispatch."""
        model, ran_from = self.models[worker.model_key], None
        for msg in replies:
            job = self.dispatcher.take_back(worker, msg.id)
            self.shared.release(msg.id)
            if job is None:
                continue
            if job.started_at is not None and job.started_at != ran_from:
                ran_from = job.started_at  # a batch's jobs started together
                model.metrics.ran(self.scheduler.now() - ran_from)
            self.book.finish(job, msg)
        self._idle_if_free(worker)  # its WantWork came before these, its last replies

    def handle_heartbeat(self, worker: WorkerHandle, beat: Heartbeat) -> None:
        worker.note_heartbeat(beat, self.scheduler.now())
        if worker.late:
            worker.late = False
            log.info("worker %d of %s beats again: it takes work", worker.worker_id,
                     worker.model_key)
            self.reconcile(self.models[worker.model_key])

    def handle_exit(self, worker: WorkerHandle, exitcode: int | None) -> None:
        exits.worker_exited(self, worker, exitcode)

    # ---- scaling --------------------------------------------------------------------

    def queued(self, model: ModelState, was_waiting: bool) -> None:
        """New work: the model is reconciled now, or once as admitting() ends. Not behind
        work that already waited with no worker free (most requests under load; each cost
        a tenth of the supervisor's time): the next freed slot or tick takes it."""
        held = self.held
        if held is not None and model.key in held:
            return
        if was_waiting and not any(w.slots > 0 for w in model.workers.values()):
            return
        if held is None:
            self.reconcile(model)
        else:
            held[model.key] = model

    def reconcile(self, model: ModelState) -> None:
        """Hand waiting work to free workers, then start workers the policy asks for."""
        self.dispatcher.dispatch(model)
        if self.shutting_down or (not len(model.queue) and model.warm_target == 0):
            return  # nothing waits and nothing is pinned: no reason to start a worker
        if not scaling.workers_wanted(capacity.model_load(model), self.policy,
                                      self.scheduler.now()):
            return  # the common case; skip building the whole view on every request
        view = self.capacity.view(self.models.values())
        self.apply(scaling.plan_starts(view, model.key, self.policy, self.scheduler.now()))

    def reconcile_waiting(self) -> None:
        for model in self.models.values():
            if len(model.queue) or len(model.live_workers()) < model.warm_target:
                self.reconcile(model)

    def apply(self, plan: scaling.Plan) -> None:
        """The one place where the scaling policy's decisions take effect."""
        now = self.scheduler.now()
        for key, waits in plan.waiting_for_memory.items():
            self.models[key].waiting_for_memory = waits
        for stop in plan.stop:
            model = self.models[stop.model_key]
            worker = model.workers.get(stop.worker_id)
            if worker is None:
                continue
            if stop.reason == "idle":
                model.last_scale_down = now
            else:
                why = scaling.STOP_REASONS[stop.reason]
                log.info("stopping worker %d of %s: %s", stop.worker_id, model.key,
                         f"{why}: {worker.outdated}" if stop.reason == "replaced" else why)
            # A load reads no Shutdown: a preempted one is killed at once.
            self.stop_worker(worker, grace_s=0.0 if stop.reason == "preempted" else None)
        if plan.stop_export:
            self.exports.stop_running()
        for start in plan.start:
            self.start_worker(self.models[start.model_key], holder=start.holder)
        if plan.start_export is not None:
            self.exports.start(plan.start_export)

    def plan_export(self) -> None:
        """Start a waiting background export if the budget has room for it now."""
        if not self.exports.waiting:
            return
        view = self.capacity.view(self.models.values())
        plan = scaling.plan_export(view)
        self.apply(plan)
        if plan.start_export is None and view.exports.running_mb is None:
            self.exports.note_no_room(scaling.cpu_free_mb(view))

    def tick(self) -> None:
        """Periodic: retire idle or outdated workers, age waiting work, retry starts."""
        now = self.scheduler.now()
        self.apply(scaling.plan_scale_down(self.capacity.view(self.models.values()),
                                           self.policy, now))
        if not self.shutting_down and any(w.outdated for m in self.models.values()
                                           for w in m.workers.values()):
            self.apply(scaling.plan_replacements(self.capacity.view(self.models.values())))
        self.plan_export()  # one waiting for memory may fit now
        every = self.pool_config.priority_aging_s
        for model in self.models.values():
            for rank in model.ageing.starved(model.queue, now, every):
                model.queue.lift(rank)
        self.retire_removed()
        self.reconcile_waiting()

    def retire_removed(self) -> None:
        """Models a reload removed: their workers stop once nothing of theirs waits or
        runs, and the model is forgotten once its processes have exited."""
        for model in [m for m in self.models.values() if m.retiring]:
            if len(model.queue) or model.running():
                continue
            for worker in model.processes():
                self.stop_worker(worker)
            if not model.processes():
                del self.models[model.key]

    def check_health(self) -> None:
        """Act on hung, starved and late workers (watch.py)."""
        watch.check(self)

    def retire_unneeded_holder(self, model: ModelState) -> None:
        if model.holder is not None and scaling.holder_unneeded(capacity.model_view(model)):
            self.stop_worker(model.holder)

    # ---- workers --------------------------------------------------------------------

    def start_worker(self, model: ModelState, holder: bool = False) -> WorkerHandle:
        worker = WorkerHandle(worker_id=next(self._worker_ids), model_key=model.key,
                              started_at=self.scheduler.now())
        if holder:
            model.holder = worker
        else:
            model.workers[worker.worker_id] = worker
        settings = model.worker_settings(worker.worker_id, holder, self.pool_config,
                                         self.config.images)
        asyncio.get_running_loop().create_task(self._launch(worker, settings))
        return worker

    async def _launch(self, worker: WorkerHandle, settings: WorkerSettings) -> None:
        try:
            await self.launcher.start(worker, settings)
        except Exception as exc:
            worker.start_error = f"{type(exc).__name__}: {exc}"
            self.handle_exit(worker, None)
            return
        worker.spawned_at = worker.progress_changed_at = self.scheduler.now()
        if worker.state is WorkerState.STOPPING:  # stopped while it was being created
            self.launcher.kill(worker)
        elif worker.state is WorkerState.STARTING:
            worker.move_to(WorkerState.LOADING)

    def stop_worker(self, worker: WorkerHandle, grace_s: float | None = None) -> None:
        """Ask the worker to exit once its current work is done; SIGKILL it if it has not
        within grace_s (default: shutdown_timeout_s + 1)."""
        if worker.state in (WorkerState.STOPPING, WorkerState.DEAD):
            return
        worker.move_to(WorkerState.STOPPING)
        worker.stop_requested = True
        if not self.launcher.shutdown(worker):
            self.launcher.kill(worker)
            return
        grace = self.pool_config.shutdown_timeout_s + 1 if grace_s is None else grace_s
        if grace <= 0:
            self.launcher.kill(worker)
            return
        worker.kill_timer = self.scheduler.call_later(grace, self.launcher.kill, worker)

    def kill_hung(self, worker: WorkerHandle, reason: str) -> None:
        """No more work for it, and SIGKILL now: a stopped or wedged process would not
        act on a gentler signal before it is continued."""
        worker.hung = reason
        self.launcher.kill(worker)

    def active_jobs(self) -> list[Job]:
        """Every accepted job still owed a final reply."""
        return [job for model in self.models.values() for job in model.active_jobs()]
