"""Handing waiting work to workers that asked for it: the best job first (priority, then
age), compatible waiting jobs coalesced into one batch, and expired work never sent.

The pool calls `dispatch` whenever a model's queue or free workers change; this is the
only place jobs go from a queue to a worker, and `take_back` the one where they leave
it, so that the threads of workers running streams follow who runs what.
"""

from __future__ import annotations

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.pipes import Threads, Work
from modelpool.supervisor.affinity import affine_first
from modelpool.supervisor.clock import Scheduler
from modelpool.supervisor.jobs import JobBook
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.queueing import Job, JobState
from modelpool.supervisor.shm import NoSharedMemory, SharedImages
from modelpool.supervisor.threads import ThreadBudget
from modelpool.supervisor.workers import WorkerHandle, WorkerState


class Dispatcher:
    def __init__(self, scheduler: Scheduler, book: JobBook, shared: SharedImages,
                 batch_wait_s: float, threads: ThreadBudget | None = None) -> None:
        self.scheduler = scheduler
        self.book = book
        self.shared = shared
        self.batch_wait_s = batch_wait_s
        self.threads = threads

    def dispatch(self, model: ModelState) -> None:
        if not len(model.queue):
            return
        free = model.free_workers()
        if len(free) > 1 and len(model.queue) == 1:
            free = self._affine_first(model, free)
        for worker in free:
            while worker.slots > 0 and len(model.queue):
                if self._wait_for_batch(model):
                    return
                batch = self._runnable(self._pop(model, worker.slots))
                if batch:
                    self._send(model, worker, batch, free)

    @staticmethod
    def _affine_first(model: ModelState, free: list[WorkerHandle]) -> list[WorkerHandle]:
        """A lone waiting request that starts as an earlier one goes to that one's worker
        if it is not much busier (affinity.py). Not a burst: its requests, all handed to
        the first worker that has slots for them, would pile onto one."""
        head = model.queue.peek()
        if head is None or head.kind.affinity is None:
            return free
        start = head.kind.affinity(head.request)
        return affine_first(free, model.affinity.worker_of.get(start))

    @staticmethod
    def _pop(model: ModelState, slots: int) -> list[Job]:
        """One batch (one slot), or one stream per slot: a worker that batches streams
        continuously takes as many as it has free sequences, in one Work."""
        jobs = model.queue.pop_batch(model.settings.max_batch)
        while jobs and not jobs[0].kind.batched and len(jobs) < slots and len(model.queue):
            jobs += model.queue.pop_batch(1)
        return jobs

    def _send(self, model: ModelState, worker: WorkerHandle, batch: list[Job],
              free: list[WorkerHandle]) -> None:
        """`free`: the model's workers this dispatch hands work to, `worker` among them."""
        items, sent = [], []
        for job in batch:
            try:
                items.append(self.shared.work_item(job.job_id, job.kind, job.request))
                sent.append(job)
            except NoSharedMemory as exc:  # that request fails; the others run
                self.book.fail(job, ErrorCode.OVERLOADED, str(exc))
        if not sent:
            return
        was_running = bool(worker.jobs)
        now = self.scheduler.now()
        size = 0
        for job in sent:
            job.state, job.worker_id, job.started_at = JobState.RUNNING, worker.worker_id, now
            worker.jobs[job.job_id] = job
            size += job.size
            model.metrics.queue_wait_s.observe(now - job.accepted_at)
        threads = 0
        if self.threads is not None:
            more = len(model.queue) > 0 and any(w is not worker and w.slots > 0 for w in free)
            threads = self.threads.grant(model, worker, siblings_take_more=more)
        if worker.state is WorkerState.IDLE:
            worker.move_to(WorkerState.BUSY)
        worker.slots -= 1 if sent[0].kind.batched else len(sent)
        worker.last_used, worker.last_dispatch_at = now, now
        model.metrics.batch(size)
        if (start_of := sent[0].kind.affinity) is not None:  # a batch is of one kind
            for job in sent:
                model.affinity.ran(start_of(job.request), worker.worker_id)
        worker.send(Work(items=items, threads=threads))
        if not was_running:
            self._rethread(worker)

    def take_back(self, worker: WorkerHandle, job_id: int) -> Job | None:
        """The job the worker replied for finally (None: not one it runs)."""
        job = worker.jobs.pop(job_id, None)
        if job is not None and not worker.jobs:
            self._rethread(worker)
        return job

    def take_all_back(self, worker: WorkerHandle) -> None:
        """The worker is gone: it runs nothing (its jobs were requeued or failed)."""
        if worker.jobs:
            worker.jobs.clear()
            self._rethread(worker)

    def _rethread(self, changed: WorkerHandle) -> None:
        """`changed` started or stopped running work: workers running streams that may
        now use more cores, or must give some back, are told their new count."""
        if self.threads is not None:
            for worker in self.threads.regrant(changed):
                worker.send(Threads(count=worker.threads))

    def _runnable(self, jobs: list[Job]) -> list[Job]:
        """Drop what expired while waiting: expired work never reaches a worker."""
        now = self.scheduler.now()
        runnable = []
        for job in jobs:
            waited_for = False
            for req in (job.parent or job).requesters:
                if not req.done and req.deadline_at is not None and req.deadline_at <= now:
                    self.book.expire(req, deadline=True)
                waited_for = waited_for or not req.done
            if waited_for:
                runnable.append(job)
        return runnable

    def _wait_for_batch(self, model: ModelState) -> bool:
        """Under load, give a small batch max_batch_wait_ms to fill before it runs.
        An idle model never waits: a lone request should not pay for batching."""
        if not model.spec.batched or self.batch_wait_s <= 0 or model.batch_waited:
            return False
        if model.batch_timer is not None:
            return True
        # Work not finished, not the BUSY state: a worker that has asked for more has
        # finished its own, whose replies follow its WantWork (and its state is BUSY
        # until they are passed on); one that has replied may be BUSY until it asks.
        busy = any(w.jobs and not w.slots for w in model.workers.values())
        if not busy or len(model.queue) >= model.settings.max_batch:
            return False
        model.batch_timer = self.scheduler.call_later(self.batch_wait_s, self._wait_over,
                                                      model)
        return True

    def _wait_over(self, model: ModelState) -> None:
        model.batch_timer, model.batch_waited = None, True
        try:
            self.dispatch(model)
        finally:
            model.batch_waited = False
