"""Is a worker alive in more than name? Pure verdicts from heartbeat and progress times.

A worker is hung when its heartbeat thread has gone quiet for heartbeat_timeout_s (the
process is stopped, deadlocked in C code that holds the GIL, or swapping to death), or
when it holds work whose progress counter has not moved for stall_timeout_s (the work
loop is stuck while the heartbeat thread still runs). A load is given load_timeout_s in
all, and fails sooner if its progress (bytes read, CPU spent) stands still for
load_stall_s: a stuck download or a wedged file system, which would otherwise hold a
load slot forever.

A worker that has not beaten once since it was forked, or that falls silent while it
loads, is not judged hung at first: it loads at idle priority (supervisor/cgroups.py,
workers/priority.py), and on a machine kept busy by normal work it may get no CPU to
start its heartbeat thread, which raises itself as its first act. A heartbeat thread
that has raised itself still needs the GIL, which the loading thread holds through long
C calls (importing torch, a dlopen): starved at idle priority, that thread keeps the
heartbeat waiting (a priority inversion), and the heartbeat's own raise of every thread
after idle_load_s waits too. The supervisor raises the whole process instead, and judges
it a heartbeat timeout later.

Before that, a ready worker silent for `late_after_s` is late: it gets no new work until
it beats again. A stopped process would hold whatever it is given until it is judged
hung, and a job that was already retried once dies with it.
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


def late_after_s(heartbeat_interval_s: float, heartbeat_timeout_s: float) -> float:
    """Four heartbeats missed, or half the timeout if that is sooner: a busy machine may
    delay one beat, not four, and a late worker should be found well before it is hung."""
    return min(4 * heartbeat_interval_s, heartbeat_timeout_s / 2)


def _last_sign(pulse: WorkerPulse) -> float:
    signs = (pulse.last_heartbeat, pulse.raised_at, pulse.started_at)
    return max(sign for sign in signs if sign is not None)


def is_late(pulse: WorkerPulse, now: float, late_s: float) -> bool:
    return now - _last_sign(pulse) > late_s


def hung_reason(pulse: WorkerPulse, now: float, limits: Limits) -> Verdict | None:
    last_sign = _last_sign(pulse)
    if now - last_sign > limits.heartbeat_timeout_s:
        return _silence(pulse, now, last_sign)
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


def _silence(pulse: WorkerPulse, now: float, last_sign: float) -> Verdict:
    """Silent past the heartbeat timeout: raised from idle priority first where it may
    be starved there (since its start, or while it loads), else hung."""
    since = ("its start" if pulse.last_heartbeat is None
             else f"its last heartbeat {now - pulse.last_heartbeat:.1f}s ago")
    if pulse.raised_at is None and (pulse.last_heartbeat is None or pulse.loading):
        return Verdict(f"no heartbeat since {since}, at idle priority", failed_load=False,
                       raise_priority=True)
    if pulse.raised_at == last_sign:
        return Verdict(f"no heartbeat since {since}, {now - last_sign:.1f}s of it at normal "
                       f"priority", failed_load=False)
    return Verdict(f"no heartbeat for {now - last_sign:.1f}s", failed_load=False)


def hung_workers(models: Iterable[ModelState], now: float,
                 limits: Limits) -> Iterator[tuple[WorkerHandle, Verdict]]:
    """Every process judged hung now, with why; those already judged are left out."""
    for model in models:
        for worker in model.processes():
            if worker.hung or worker.spawned_at is None or worker.state in (
                    WorkerState.STARTING, WorkerState.DEAD):
                continue  # not a process yet: the forkserver may still import torch
            own = dataclasses.replace(limits, stall_timeout_s=model.settings.stall_timeout_s)
            verdict = hung_reason(_pulse(worker, worker.spawned_at), now, own)
            if verdict:
                yield worker, verdict


def late_workers(models: Iterable[ModelState], now: float,
                 late_s: float) -> Iterator[WorkerHandle]:
    """Ready workers silent for more than late_s, not (yet) judged hung nor late."""
    for model in models:
        for worker in model.workers.values():
            if (worker.ready and not worker.hung and not worker.late
                    and worker.spawned_at is not None
                    and is_late(_pulse(worker, worker.spawned_at), now, late_s)):
                yield worker


def _pulse(worker: WorkerHandle, spawned_at: float) -> WorkerPulse:
    return WorkerPulse(spawned_at, worker.last_heartbeat,
                       max(worker.progress_changed_at, worker.last_dispatch_at),
                       bool(worker.jobs), loading=worker.state in LOADING,
                       raised_at=worker.raised_at)
