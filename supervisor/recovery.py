"""What a worker's death means: pure verdicts the pool acts on when a worker exits.

Requests are idempotent, so a dead worker's job runs again, once, unless a stream of it
already reached its client; a load failure is told apart from a death so that the model
backs off instead of restarting in a loop.
"""

from __future__ import annotations

from modelpool.supervisor.queueing import Job
from modelpool.supervisor.workers import WorkerHandle
from modelpool.workers import exitcodes


def load_failure(worker: WorkerHandle) -> str | None:
    """Why its load failed: only what the loader itself reported (LoadFailed), or a load
    that timed out or stalled. None for every other exit."""
    return None if worker.stop_requested else worker.load_error


def death_before_ready(worker: WorkerHandle, exitcode: int | None,
                       holder: bool = False, cause: str | None = None) -> str | None:
    """Why a worker died before Ready, its loader blameless (killed by a signal or the
    OOM killer, or never started); None if it was ready, stopped by us, or its load
    failed."""
    if worker.stop_requested or worker.ready_at is not None or worker.load_error:
        return None
    what = "weights holder" if holder else "worker"
    if worker.start_error is not None:
        return f"{what} could not start: {worker.start_error}"
    if exitcode == exitcodes.OK:
        return None
    return f"{what} died while loading: {cause or exitcodes.describe(exitcode)}"


def death_verdict(job: Job, pid: int | None, exitcode: int | None,
                  cause: str | None = None) -> str | None:
    """None: queue the job again. Else why it fails with WORKER_DIED (`cause`: the exit
    in words, when more is known than its code, such as an OOM kill)."""
    why = f"worker pid {pid} of {job.model_key!r} died ({cause or exitcodes.describe(exitcode)})"
    if job.chunks_sent > 0:
        return f"{why} after {job.chunks_sent} chunks"
    if job.retries >= 1:
        return f"{why}; the request was already retried"
    return None
