"""Is a worker alive in more than name? Pure verdicts from heartbeat and progress times.

A worker is hung when its heartbeat thread has gone quiet for heartbeat_timeout_s (the
process is stopped, deadlocked in C code that holds the GIL, or swapping to death), or
when it holds work whose progress counter has not moved for stall_timeout_s (the work
loop is stuck while the heartbeat thread still runs). A load is given load_timeout_s in
all, and fails sooner if its progress (bytes read, CPU spent) stands still for
load_stall_s: a stuck download or a wedged file system, which would otherwise hold a
load slot forever.

A worker that has not beaten once since it was forked is not judged hung at first: it
starts at idle priority (supervisor/cgroups.py, workers/priority.py), and on a machine
kept busy by normal work it may get no CPU to start its heartbeat thread, which raises
itself as its first act. The supervisor raises it instead, and judges it a heartbeat
timeout later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from modelpool.supervisor.models import LOADING, ModelState
from modelpool.supervisor.workers import WorkerHandle, WorkerState


@dataclass(frozen=True)
class Limits:
    heartbeat_timeout_s: float
    stall_timeout_s: float
    load_timeout_s: float
    load_stall_s: float


@dataclass(frozen=True)
class WorkerPulse:
    started_at: float
    last_heartbeat: float | None
    progress_changed_at: float
    busy: bool
    loading: bool = False
    raised_at: float | None = None  # when the supervisor raised it from idle priority


@dataclass(frozen=True)
class Verdict:
    reason: str
    failed_load: bool  # the load, not the process, is what failed: a load failure
    raise_priority: bool = False  # not hung yet: silent since its start, at idle priority


def hung_reason(pulse: WorkerPulse, now: float, limits: Limits) -> Verdict | None:
    last_sign = pulse.last_heartbeat
    if last_sign is None:
        last_sign = pulse.started_at if pulse.raised_at is None else pulse.raised_at
    if now - last_sign > limits.heartbeat_timeout_s:
        if pulse.last_heartbeat is not None:
            return Verdict(f"no heartbeat for {now - last_sign:.1f}s", failed_load=False)
        if pulse.raised_at is None:
            return Verdict(f"no heartbeat in the {now - last_sign:.1f}s since its start at "
                           f"idle priority", failed_load=False, raise_priority=True)
        return Verdict(f"no heartbeat in the {now - pulse.started_at:.1f}s since its start, "
                       f"{now - last_sign:.1f}s of them at normal priority", failed_load=False)
    still = now - pulse.progress_changed_at
    if pulse.loading:
        if now - pulse.started_at > limits.load_timeout_s:
            return Verdict(f"still loading after {now - pulse.started_at:.0f}s "
                           f"(load_timeout_s)", failed_load=True)
        if still > limits.load_stall_s:
            return Verdict(f"no loading progress for {still:.0f}s (load_stall_s)",
                           failed_load=True)
    if pulse.busy and still > limits.stall_timeout_s:
        return Verdict(f"no progress on its work for {still:.1f}s", failed_load=False)
    return None


def hung_workers(models: Iterable[ModelState], now: float,
                 limits: Limits) -> Iterator[tuple[WorkerHandle, Verdict]]:
    """Every process judged hung now, with why; those already judged are left out."""
    for model in models:
        for worker in model.processes():
            if worker.hung or worker.spawned_at is None or worker.state in (
                    WorkerState.STARTING, WorkerState.DEAD):
                continue  # not a process yet: the forkserver may still import torch
            pulse = WorkerPulse(worker.spawned_at, worker.last_heartbeat,
                                max(worker.progress_changed_at, worker.last_dispatch_at),
                                bool(worker.jobs), loading=worker.state in LOADING,
                                raised_at=worker.raised_at)
            own = dataclasses.replace(limits, stall_timeout_s=model.settings.stall_timeout_s)
            verdict = hung_reason(pulse, now, own)
            if verdict:
                yield worker, verdict
