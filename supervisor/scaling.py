"""When to start and stop a model's workers: pure functions of (model load, clock, memory).

Rules (DESIGN.md, "Pool semantics"):
- cold start: a model with no live worker and waiting work starts `cold_start_workers`
  at once (fewer if memory or the load limit allow fewer);
- scale up: +1 when every worker is busy, work is waiting and no start is in flight;
- scale down: -1 per `cooldown_idle_s` of whole-model idleness, down to 0;
- `modelpool load` keeps a warm minimum up (and exempt from scale-down) until `unload`;
- nothing starts while a failed load backs off or after the model is marked failed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLoad:
    queued: int
    live: int  # workers not stopping and not dead
    starting: int  # of live: still starting or loading
    idle: int  # of live: ready and waiting for work
    busy: int  # of live: running work
    max_workers: int
    last_active: float  # last arrival or completion of a request
    last_scale_down: float
    blocked_until: float = 0.0  # load back-off
    failed: bool = False
    warm: int = 0  # workers kept up even without work (`modelpool load`)


@dataclass(frozen=True)
class ScalingPolicy:
    cold_start_workers: int = 2
    cooldown_idle_s: float = 60.0


def cpu_plan(cpus: int, cold_start_workers: int, threads: int, max_workers: int) -> tuple[int, int]:
    """(threads per worker, max workers) for CPU models; 0 in the config means auto.

    On the CPU more busy threads than cores only adds contention, so by default the
    cold-start workers share the cores, and a model grows no further than the cores
    it can keep busy."""
    threads = threads or max(1, cpus // cold_start_workers)
    return threads, max_workers or max(cold_start_workers, cpus // threads)


def workers_to_start(load: ModelLoad, policy: ScalingPolicy, now: float, room: int) -> int:
    """How many workers to start now; room is what memory and the load limit allow."""
    if load.failed or now < load.blocked_until or room <= 0:
        return 0
    headroom = load.max_workers - load.live
    want = 0
    if load.queued and load.live == 0:
        want = policy.cold_start_workers
    elif load.queued and load.starting == 0 and load.idle == 0:
        want = 1
    want = max(want, load.warm - load.live)
    return max(0, min(want, headroom, room))


def should_stop_one(load: ModelLoad, policy: ScalingPolicy, now: float) -> bool:
    """True when the whole model has been idle for a full cooldown since the last change."""
    if load.live <= load.warm or load.queued or load.busy or load.starting:
        return False
    idle_since = max(load.last_active, load.last_scale_down)
    return now - idle_since >= policy.cooldown_idle_s
