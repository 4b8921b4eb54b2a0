"""What the pool does when one of its processes exits: a worker's jobs queued again or
failed (recovery.py's verdicts), a failed start counted against its model, a weights
holder's segment removed and its workers moved off its weights.

Functions of the pool, which owns every piece of state they change; `Pool.handle_exit`
(its WorkerEvents method) calls `worker_exited`.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor import pressure, recovery
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.queueing import Job, JobState
from modelpool.supervisor.shm import unlink_segment, weights_segment
from modelpool.supervisor.workers import WorkerHandle, WorkerState
from modelpool.workers import exitcodes

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Pool

log = logging.getLogger("modelpool.pool")


def worker_exited(pool: Pool, worker: WorkerHandle, exitcode: int | None) -> None:
    worker.move_to(WorkerState.DEAD)
    if worker.kill_timer is not None:
        worker.kill_timer.cancel()
    model = pool.models[worker.model_key]
    if worker is model.holder:
        _holder_exited(pool, model, worker, exitcode)
    else:
        model.workers.pop(worker.worker_id, None)
        expected = exitcode == exitcodes.OK and not worker.jobs
        cause = exit_cause(pool, worker, exitcode)
        log.log(logging.INFO if expected else logging.WARNING,
                "worker %d (pid %s) of %s exited: %s", worker.worker_id, worker.pid,
                model.key, cause)
        _note_failed_start(pool, model, worker, exitcode, cause=cause)
        if worker.ready_at is not None and not worker.stop_requested:
            model.metrics.worker_deaths += 1
        for job in worker.jobs.values():
            pool.shared.release(job.job_id)
            _requeue_or_fail(pool, model, job, worker, exitcode, cause)
        pool.dispatcher.take_all_back(worker)
        pool.retire_unneeded_holder(model)
    pool.changed.set()
    if model.retiring:
        pool.retire_removed()  # its last process gone: so is the model
    pool.reconcile_waiting()  # its memory and maybe its load slot are free again


def _holder_exited(pool: Pool, model: ModelState, holder: WorkerHandle,
                   exitcode: int | None) -> None:
    model.holder, model.shared_weights = None, None
    # By its name, which the supervisor chose: also when it died half-way through
    # writing it. Workers' mappings outlive the name.
    unlink_segment(weights_segment(holder.worker_id))
    log.log(logging.INFO if holder.stop_requested else logging.WARNING,
            "weights holder (pid %s) of %s exited: %s", holder.pid, model.key,
            exitcodes.describe(exitcode))
    if holder.stop_requested:
        return
    if holder.ready_at is None:
        _note_failed_start(pool, model, holder, exitcode, holder=True)
        return
    # CUDA memory shared over IPC dies with its exporter: its workers must not run
    # one more kernel on it (their work is re-queued). CPU mappings outlive it: those
    # workers finish their work and make way for ones on the next holder's weights.
    # Loading ones too: their weights are gone, and their failing is no load failure.
    on_gpu = (model.device or "cpu") != "cpu"
    for worker in model.live_workers():
        if on_gpu:
            worker.stop_requested = True
            pool.kill_hung(worker, "its weights holder died")
        else:
            pool.stop_worker(worker)


def exit_cause(pool: Pool, worker: WorkerHandle, exitcode: int | None) -> str:
    """The exit in words; a SIGKILL the pool did not send is checked against the
    cgroup's OOM kill count (supervisor/pressure.py)."""
    ours = worker.stop_requested or worker.hung is not None
    kills = pool.oom.new_kills() if exitcode == -signal.SIGKILL and not ours else 0
    return pressure.exit_cause(exitcode, ours, kills)


def _note_failed_start(pool: Pool, model: ModelState, worker: WorkerHandle,
                       exitcode: int | None, holder: bool = False,
                       cause: str | None = None) -> None:
    """A loader that failed backs off and fails what waits (unless a sibling serves);
    a process that died for any other reason backs off and is started again."""
    now = pool.scheduler.now()
    if (failure := recovery.load_failure(worker)) is not None:
        model.note_load_failure(worker.started_at, failure, now)
        log.error("model %s failed to load (%d in a row): %s", model.key,
                  model.failures.count, failure)
        if not model.has_ready_worker():
            for job in model.queue.jobs():
                pool.book.fail(job, ErrorCode.MODEL_LOAD_FAILED,
                               f"model {model.key!r}: {failure}")
    elif (death := recovery.death_before_ready(worker, exitcode, holder,
                                                cause)) is not None:
        model.note_death(worker.started_at, death, now)
        log.warning("model %s: %s (%d in a row); starting again in %.1fs", model.key,
                    death, model.deaths.count, model.deaths.blocked_until - now)


def _requeue_or_fail(pool: Pool, model: ModelState, job: Job, worker: WorkerHandle,
                     exitcode: int | None, cause: str | None = None) -> None:
    if job.state is JobState.DONE:
        return
    why = recovery.death_verdict(job, worker.pid, exitcode, cause)
    if why is not None:
        pool.book.fail(job, ErrorCode.WORKER_DIED, why)
        return
    job.retries += 1
    job.state, job.worker_id = JobState.QUEUED, None
    model.queue.push_front(job)
