"""When workers load, beat, hang or die: readiness, load failures with back-off, hang
kills, and re-queueing a dead worker's work. Called by the Pool on its event loop."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.pipes import Heartbeat, Ready
from modelpool.supervisor import health
from modelpool.supervisor.queueing import Job, JobState
from modelpool.supervisor.shm import unlink_segment, weights_segment
from modelpool.supervisor.workers import WorkerHandle, WorkerState
from modelpool.workers import exitcodes

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelState, Pool

log = logging.getLogger("modelpool.recovery")

HUNG_KILL_GRACE_S = 1.0  # SIGTERM first so a worker can flush its logs; then SIGKILL


def on_ready(pool: Pool, model: ModelState, worker: WorkerHandle, msg: Ready) -> None:
    worker.info, worker.load_s = msg.info, round(msg.load_s, 3)
    worker.last_used = worker.ready_at = pool.clock()
    model.load_failures, model.blocked_until, model.last_error = 0, 0.0, None
    model.last_failure_at = None
    if worker is model.holder:
        worker.state, worker.uss_mb = WorkerState.HOLDING, msg.uss_mb
        model.shared_weights = msg.weights
        model.measured_weights_mb = msg.vram_mb if msg.vram_mb is not None else msg.weights_mb
        log.info("weights holder of %s ready: pid %d, %.0f MiB shared, loaded in %.2fs",
                 model.spec.key, msg.pid, model.measured_weights_mb or 0, msg.load_s)
        return
    if msg.weights_mb is not None:
        model.measured_weights_mb = msg.weights_mb
    pool.capacity.note_uss(model, worker, msg.uss_mb)
    pool.capacity.note_vram(model, msg.vram_mb)
    log.info("worker %d of %s ready: pid %d, loaded in %.2fs, USS %.0f MiB",
             worker.worker_id, model.spec.key, msg.pid, msg.load_s, msg.uss_mb or 0)


def on_heartbeat(pool: Pool, worker: WorkerHandle, beat: Heartbeat) -> None:
    now = pool.clock()
    worker.last_heartbeat = now
    if beat.progress != worker.progress:
        worker.progress, worker.progress_changed_at = beat.progress, now


def check_health(pool: Pool) -> None:
    """Kill hung workers; their exit re-queues their work like any other death."""
    now = pool.clock()
    config = pool.pool_config
    for model in pool.models.values():
        stall_s = model.spec.stall_timeout_s or config.stall_timeout_s
        for worker in model.processes():
            if worker.hung or worker.spawned_at is None or worker.state in (
                    WorkerState.STARTING, WorkerState.DEAD):
                continue  # not a process yet: the forkserver may still be importing torch
            pulse = health.WorkerPulse(
                worker.spawned_at, worker.last_heartbeat,
                max(worker.progress_changed_at, worker.last_dispatch_at), bool(worker.jobs))
            reason = health.hung_reason(pulse, now, config.heartbeat_timeout_s, stall_s)
            if reason:
                worker.hung = reason
                log.warning("worker %d (pid %s) of %s is hung (%s): terminating it",
                            worker.worker_id, worker.pid, model.spec.key, reason)
                pool.launcher.terminate(worker, HUNG_KILL_GRACE_S)


def on_exit(pool: Pool, worker: WorkerHandle, exitcode: int | None) -> None:
    model = pool.models[worker.model_key]
    if worker is model.holder:
        _holder_exited(pool, model, worker, exitcode)
        return
    model.workers.pop(worker.worker_id, None)
    expected = exitcode == exitcodes.OK and not worker.jobs
    log.log(logging.INFO if expected else logging.WARNING, "worker %d (pid %s) of %s exited: %s",
            worker.worker_id, worker.pid, model.spec.key, exitcodes.describe(exitcode))
    if worker.ready_at is None and exitcode != exitcodes.OK and worker.load_error is None:
        worker.load_error = f"worker exited while loading: {exitcodes.describe(exitcode)}"
    if worker.load_error is not None and not worker.stop_requested:
        _load_failed(pool, model, worker, worker.load_error)  # ours to stop: no failure
    for job in worker.jobs.values():
        pool.shared.release(job.job_id)
        _recover(pool, job, worker, exitcode)
    worker.jobs.clear()
    stop_unused_holder(pool, model)
    pool.changed.set()


def stop_unused_holder(pool: Pool, model: ModelState) -> None:
    """A holder lives exactly as long as some worker may map its weights."""
    holder = model.holder
    if holder is None or holder.state in (WorkerState.STOPPING, WorkerState.DEAD):
        return
    if not model.workers and not len(model.queue) and model.warm_target == 0:
        pool.launcher.stop(holder, pool.pool_config.shutdown_timeout_s + 1)


def _holder_exited(pool: Pool, model: ModelState, holder: WorkerHandle,
                   exitcode: int | None) -> None:
    model.holder, model.shared_weights = None, None
    pool.changed.set()
    # By its name, which the supervisor chose: also when it died half-way through writing
    # it. Workers' mappings outlive the name.
    unlink_segment(weights_segment(holder.worker_id))
    log.log(logging.INFO if holder.stop_requested else logging.WARNING,
            "weights holder (pid %s) of %s exited: %s", holder.pid, model.spec.key,
            exitcodes.describe(exitcode))
    if holder.stop_requested:
        return
    if holder.ready_at is None:
        _load_failed(pool, model, holder, holder.load_error
                     or f"weights holder exited while loading: {exitcodes.describe(exitcode)}")
    else:
        # CUDA memory shared over IPC dies with its exporter: its workers must not run one
        # more kernel on it (their work is re-queued). CPU mappings outlive it: those
        # workers finish their work and make way for ones on the next holder's weights.
        # Loading ones too: their weights are gone, and their failing is no load failure.
        on_gpu = (model.device or "cpu") != "cpu"
        for worker in model.live_workers():
            if on_gpu:
                worker.hung = "its weights holder died"  # no more work goes to it
                worker.stop_requested = True
                pool.launcher.terminate(worker, HUNG_KILL_GRACE_S)
            else:
                pool.launcher.stop(worker, pool.pool_config.shutdown_timeout_s + 1)


def _recover(pool: Pool, job: Job, worker: WorkerHandle, exitcode: int | None) -> None:
    """Requests are idempotent: run a dead worker's job again, once, unless a stream
    already reached its client."""
    if job.state is JobState.DONE:
        return
    why = f"worker pid {worker.pid} of {job.model_key!r} died ({exitcodes.describe(exitcode)})"
    if job.chunks_sent > 0:
        pool.book.fail(job, ErrorCode.WORKER_DIED, f"{why} after {job.chunks_sent} chunks")
    elif job.retries >= 1:
        pool.book.fail(job, ErrorCode.WORKER_DIED, f"{why}; the request was already retried")
    else:
        job.retries += 1
        job.state, job.worker_id = JobState.QUEUED, None
        pool.models[job.model_key].queue.push_front(job)


def _load_failed(pool: Pool, model: ModelState, worker: WorkerHandle, cause: str) -> None:
    now = pool.clock()
    # Workers started together fail together: one attempt, one failure.
    if model.last_failure_at is None or worker.started_at > model.last_failure_at:
        model.last_failure_at = now
        model.load_failures += 1
        backoff = min(pool.pool_config.load_backoff_s * 2 ** (model.load_failures - 1),
                      pool.pool_config.load_backoff_max_s)
        model.blocked_until = now + backoff
    model.last_error = cause
    log.error("model %s failed to load (%d in a row): %s", model.spec.key,
              model.load_failures, cause)
    if any(w.ready for w in model.workers.values()):
        return  # a sibling serves; the queue keeps waiting for it
    for job in model.queue.jobs():
        pool.book.fail(job, ErrorCode.MODEL_LOAD_FAILED, f"model {model.spec.key!r}: {cause}")
