"""Is a worker alive in more than name? Pure verdicts from heartbeat and progress times.

A worker is hung when its heartbeat thread has gone quiet for heartbeat_timeout_s (the
process is stopped, deadlocked in C code that holds the GIL, or swapping to death), or
when it holds work whose progress counter has not moved for stall_timeout_s (the work
loop is stuck while the heartbeat thread still runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from modelpool.supervisor.models import ModelState
from modelpool.supervisor.workers import WorkerHandle, WorkerState


@dataclass(frozen=True)
class WorkerPulse:
    started_at: float
    last_heartbeat: float | None
    progress_changed_at: float
    busy: bool


def hung_reason(pulse: WorkerPulse, now: float, heartbeat_timeout_s: float,
                stall_timeout_s: float) -> str | None:
    last_sign = pulse.last_heartbeat if pulse.last_heartbeat is not None else pulse.started_at
    if now - last_sign > heartbeat_timeout_s:
        return f"no heartbeat for {now - last_sign:.1f}s"
    if pulse.busy and now - pulse.progress_changed_at > stall_timeout_s:
        return f"no progress on its work for {now - pulse.progress_changed_at:.1f}s"
    return None


def hung_workers(models: Iterable[ModelState], now: float,
                 heartbeat_timeout_s: float) -> Iterator[tuple[WorkerHandle, str]]:
    """Every process judged hung now, with why; those already judged are left out."""
    for model in models:
        for worker in model.processes():
            if worker.hung or worker.spawned_at is None or worker.state in (
                    WorkerState.STARTING, WorkerState.DEAD):
                continue  # not a process yet: the forkserver may still import torch
            pulse = WorkerPulse(worker.spawned_at, worker.last_heartbeat,
                                max(worker.progress_changed_at, worker.last_dispatch_at),
                                bool(worker.jobs))
            reason = hung_reason(pulse, now, heartbeat_timeout_s, model.settings.stall_timeout_s)
            if reason:
                yield worker, reason
