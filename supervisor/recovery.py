"""What a worker's death means: pure verdicts the pool acts on when a worker exits.

Requests are idempotent, so a dead worker's job runs again, once, unless a stream of it
already reached its client; a load failure is told apart from a death so that the model
backs off instead of restarting in a loop.
"""

from __future__ import annotations

from modelpool.supervisor.queueing import Job
from modelpool.supervisor.workers import WorkerHandle
from modelpool.workers import exitcodes

HUNG_KILL_GRACE_S = 1.0  # SIGTERM first so a worker can flush its logs; then SIGKILL


def load_failure(worker: WorkerHandle, exitcode: int | None, holder: bool = False) -> str | None:
    """Why the worker failed to load, or None when its exit is no load failure (it had
    loaded, or we stopped it)."""
    if worker.stop_requested:
        return None
    if worker.load_error is not None:
        return worker.load_error
    if worker.ready_at is None and exitcode != exitcodes.OK:
        what = "weights holder" if holder else "worker"
        return f"{what} exited while loading: {exitcodes.describe(exitcode)}"
    return None


def death_verdict(job: Job, pid: int | None, exitcode: int | None) -> str | None:
    """None: queue the job again. Else why it fails with WORKER_DIED."""
    why = f"worker pid {pid} of {job.model_key!r} died ({exitcodes.describe(exitcode)})"
    if job.chunks_sent > 0:
        return f"{why} after {job.chunks_sent} chunks"
    if job.retries >= 1:
        return f"{why}; the request was already retried"
    return None
