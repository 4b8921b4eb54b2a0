"""When to start and stop workers: pure functions of a frozen view of the pool and the
clock, returning a Plan that the pool applies in one place.

Rules:
- cold start: a model with no live worker and waiting work starts `cold_start_workers`
  at once (fewer if memory or the load limit allow fewer);
- scale up: +1 when every worker is busy, work is waiting and no start is in flight;
- scale down: -1 per `cooldown_idle_s` of whole-model idleness, down to 0;
- `modelpool load` keeps a warm minimum up (and exempt from scale-down) until `unload`;
- nothing starts while a failed load backs off or after the model is marked failed, nor
  while the ONNX export its workers must load (execution = "onnx") is being made;
- memory: a start that does not fit the budget evicts idle workers of other models on
  the same device, least recently used first, or else waits for memory;
- load slots: every waiting model gets one before any model gets a second, even if
  that means stopping another model's extra load (one that is not its first);
- a weights holder starts before its model's workers and stops when none is left;
- an outdated worker (its model's ONNX export became ready) is replaced by a new one,
  one at a time per model: an idle one, or a busy one while another worker serves;
- a background ONNX export starts, one at a time, when what the CPU budget leaves holds
  its expected peak; it never evicts a worker, and it stops (to be made again later)
  when a worker start needs the memory it holds: serving comes first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from modelpool.supervisor import memory

HolderState = str  # "none" | "loading" | "holding" | "stopping"


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
    awaits_export: bool = False  # its workers load an export still being made


@dataclass(frozen=True)
class ModelView:
    """One model as the policy sees it."""

    key: str
    load: ModelLoad
    device: str
    charge: memory.ModelCharge
    uses_holder: bool = False
    holder: HolderState = "none"
    idle_workers: tuple[tuple[int, float], ...] = ()  # (worker id, last used), no work held
    loading_workers: tuple[tuple[int, float], ...] = ()  # (worker id, started at)
    outdated_workers: tuple[tuple[int, bool], ...] = ()  # (worker id, idle), ready ones


@dataclass(frozen=True)
class ExportView:
    """The background ONNX exports (on the CPU), as the policy sees them."""

    running_mb: float | None = None  # the running one's expected peak; None: none runs
    waiting: tuple[tuple[str, float], ...] = ()  # (cache entry, expected peak), oldest first


@dataclass(frozen=True)
class PoolView:
    models: Mapping[str, ModelView]
    loading: int  # processes starting or loading, all models
    max_concurrent_loads: int
    budget_mb: Mapping[str, float]  # by device
    used_mb: Mapping[str, float]  # by device, workers only (not a running export)
    freeing: frozenset[str] = frozenset()  # devices where a stopping worker frees memory
    exports: ExportView = ExportView()


@dataclass(frozen=True)
class Start:
    model_key: str
    holder: bool = False


@dataclass(frozen=True)
class Stop:
    worker_id: int
    model_key: str
    reason: str  # "idle" (scale-down) or one of STOP_REASONS


STOP_REASONS = {
    "evicted": "idle, to make room for another model",
    "preempted": "an extra load, stopped so that another model's first can start",
    "replaced": "a new worker serves better",
}


@dataclass(frozen=True)
class Plan:
    start: tuple[Start, ...] = ()
    stop: tuple[Stop, ...] = ()
    waiting_for_memory: Mapping[str, bool] = field(default_factory=dict)
    start_export: str | None = None  # the cache entry of the export to start
    stop_export: bool = False  # the running export yields its memory to these starts


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


def workers_wanted(load: ModelLoad, policy: ScalingPolicy, now: float) -> int:
    """Workers the model would start now if memory and load slots allowed."""
    if load.failed or now < load.blocked_until or load.awaits_export:
        return 0
    want = 0
    if load.queued and load.live == 0:
        want = policy.cold_start_workers
    elif load.queued and load.starting == 0 and load.idle == 0:
        want = 1
    want = max(want, load.warm - load.live)
    return max(0, min(want, load.max_workers - load.live))


def plan_starts(view: PoolView, key: str, policy: ScalingPolicy, now: float) -> Plan:
    """What to start for one model, or whom to evict or preempt so that it can start.
    Every waiting model gets one load slot before any model gets a second."""
    model = view.models[key]
    want = workers_wanted(model.load, policy, now)
    if want == 0:
        return Plan()
    room = memory.room_for(model.charge, view.used_mb.get(model.device, 0.0),
                           view.budget_mb.get(model.device, 0.0))
    slots = view.max_concurrent_loads - view.loading
    if room == 0:
        if slots <= 0:
            return Plan()
        return Plan(stop=_evictions(view, model), waiting_for_memory={key: True})
    preempt: tuple[Stop, ...] = ()
    if model.load.live == 0 and slots <= 0:
        preempt = _preemption(view, model)
        slots += len(preempt)
    elif model.load.live > 0:
        slots -= _waiting_for_a_first_worker(view, key, now)
    count = min(want, slots, room)
    if count <= 0:
        return Plan()
    waiting = {key: False}
    if model.uses_holder and model.holder != "holding":
        # Workers start once a holder shares its weights (not one that is stopping).
        holder = (Start(key, holder=True),) if model.holder == "none" else ()
        return Plan(start=holder, stop=preempt if holder else (), waiting_for_memory=waiting,
                    stop_export=_export_yields(view, _cpu_need(model, len(holder))))
    return Plan(start=(Start(key),) * count, stop=preempt, waiting_for_memory=waiting,
                stop_export=_export_yields(view, _cpu_need(model, count)))


def _cpu_need(model: ModelView, starts: int) -> float:
    """The CPU memory these starts of the model add."""
    if model.device != "cpu" or starts <= 0:
        return 0.0
    return model.charge.next_worker_mb + (starts - 1) * model.charge.per_worker_mb


def cpu_free_mb(view: PoolView) -> float:
    """What the CPU budget leaves beside the workers, a running export's memory in it."""
    return view.budget_mb.get("cpu", 0.0) - view.used_mb.get("cpu", 0.0)


def _export_yields(view: PoolView, need_mb: float) -> bool:
    """Starts that need need_mb of CPU memory need some that a running export holds."""
    running = view.exports.running_mb
    return running is not None and need_mb > 0 and need_mb > cpu_free_mb(view) - running


def plan_export(view: PoolView) -> Plan:
    """The oldest waiting export whose expected peak fits in what the CPU budget leaves,
    while none runs."""
    if view.exports.running_mb is not None:
        return Plan()
    free = cpu_free_mb(view)
    return Plan(start_export=next(
        (entry for entry, peak in view.exports.waiting if peak <= free), None))


def _waiting_for_a_first_worker(view: PoolView, key: str, now: float) -> int:
    return sum(1 for other in view.models.values()
               if other.key != key and other.load.queued and other.load.live == 0
               and not other.load.failed and now >= other.load.blocked_until)


def _preemption(view: PoolView, model: ModelView) -> tuple[Stop, ...]:
    """The newest load of another model that is not that model's only way to serve (it
    has a worker ready, or another one loading): stopped for this model's first."""
    candidates = [
        (started, worker_id, other.key)
        for other in view.models.values() if other.key != model.key
        and (other.load.live - other.load.starting >= 1 or len(other.loading_workers) >= 2)
        for worker_id, started in other.loading_workers]
    if not candidates:
        return ()
    _, worker_id, owner = max(candidates)
    return (Stop(worker_id, owner, "preempted"),)


def _evictions(view: PoolView, model: ModelView) -> tuple[Stop, ...]:
    """Idle workers of other idle models on the same device, least recently used first,
    whose exit makes room; none while memory is already being freed there."""
    if model.device in view.freeing:
        return ()  # decide again when those workers exit
    candidates = [
        memory.EvictionCandidate(worker_id, other.key, last_used, other.charge.per_worker_mb,
                                 other.charge.weights_mb, other.charge.workers,
                                 other.charge.shared_weights)
        for other in view.models.values()
        if other.key != model.key and not other.load.queued and other.device == model.device
        for worker_id, last_used in other.idle_workers]
    free = view.budget_mb.get(model.device, 0.0) - view.used_mb.get(model.device, 0.0)
    chosen = memory.pick_evictions(candidates, model.charge.next_worker_mb - free)
    owner = {c.worker_id: c.model_key for c in candidates}
    return tuple(Stop(worker_id, owner[worker_id], "evicted") for worker_id in chosen)


def plan_scale_down(view: PoolView, policy: ScalingPolicy, now: float) -> Plan:
    """One least recently used idle worker of each model idle for a full cooldown."""
    stops = []
    for model in view.models.values():
        if model.idle_workers and should_stop_one(model.load, policy, now):
            worker_id, _ = min(model.idle_workers, key=lambda w: w[1])
            stops.append(Stop(worker_id, model.key, "idle"))
    return Plan(stop=tuple(stops))


def plan_replacements(view: PoolView) -> Plan:
    """For each model with outdated workers and none loading: one of them stopped (it
    finishes its work first) and a new worker started, if memory and a load slot allow.
    Busy ones only while another worker of the model serves. Without memory for one
    more worker, an idle outdated one stops alone: its successor starts in its room
    when work asks for it (else an outdated worker could serve on forever)."""
    slots = view.max_concurrent_loads - view.loading
    stops, starts = [], []
    for model in view.models.values():
        load = model.load
        if not model.outdated_workers or load.starting or slots <= 0:
            continue
        idle = [worker_id for worker_id, is_idle in model.outdated_workers if is_idle]
        if memory.room_for(model.charge, view.used_mb.get(model.device, 0.0),
                           view.budget_mb.get(model.device, 0.0)) == 0:
            if idle:
                stops.append(Stop(idle[0], model.key, "replaced"))
            continue
        if not idle and load.live - load.starting < 2:
            continue
        worker_id = idle[0] if idle else model.outdated_workers[0][0]
        stops.append(Stop(worker_id, model.key, "replaced"))
        starts.append(Start(model.key))
        slots -= 1
    need = sum(_cpu_need(view.models[start.model_key], 1) for start in starts)
    return Plan(start=tuple(starts), stop=tuple(stops), stop_export=_export_yields(view, need))


def should_stop_one(load: ModelLoad, policy: ScalingPolicy, now: float) -> bool:
    """True when the whole model has been idle for a full cooldown since the last change."""
    if load.live <= load.warm or load.queued or load.busy or load.starting:
        return False
    idle_since = max(load.last_active, load.last_scale_down)
    return now - idle_since >= policy.cooldown_idle_s


def holder_unneeded(model: ModelView) -> bool:
    """A holder lives exactly as long as some worker may map its weights."""
    return (model.holder in ("loading", "holding") and model.charge.workers == 0
            and not model.load.queued and model.load.warm == 0)
