"""The memory budget and the frozen views of the pool that the scaling policy reads.

Budgets are memory_fraction x RAM for the CPU (or memory_budget_mb), and x VRAM for
each GPU; what each model is charged comes from the model itself (ModelState.charge),
and on the CPU a background ONNX export's expected peak while it runs (exports.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from modelpool.supervisor import memory, pressure, scaling
from modelpool.supervisor.config import PoolConfig
from modelpool.supervisor.gpus import Gpu
from modelpool.supervisor.models import LOADING, ModelState
from modelpool.supervisor.workers import WorkerState


class Capacity:
    def __init__(self, config: PoolConfig, gpus: list[Gpu],
                 exports: Callable[[], scaling.ExportView] = scaling.ExportView) -> None:
        self.gpus = gpus
        self.exports = exports  # the background exports, whose running one holds memory
        self.follow_config(config)

    def follow_config(self, config: PoolConfig) -> None:
        """The budgets of this [pool] (at start, and after a reload changed it); the
        server refines the CPU's from the machine at once (follow_machine)."""
        self.config = config
        self.budget_mb = (config.memory_budget_mb
                          or config.memory_fraction * memory.read_memory().total_mb)
        self.gpu_budgets_mb = {g.device: config.memory_fraction * g.total_mb
                               for g in self.gpus}

    def follow_machine(self, facts: memory.MemoryFacts, cgroup: pressure.CgroupMemory,
                       used_mb: float) -> None:
        """The CPU budget from the machine as it is now: its cgroup limit and what other
        processes leave available (supervisor/pressure.py)."""
        self.budget_mb = pressure.effective_budget(
            facts.total_mb, facts.available_mb, cgroup, self.config.memory_fraction,
            self.config.memory_budget_mb, used_mb)

    def budget_for(self, device: str) -> float:
        """memory_fraction x RAM for the CPU, x VRAM for each GPU."""
        return self.budget_mb if device == "cpu" else self.gpu_budgets_mb.get(device, 0.0)

    def used_mb(self, models: Iterable[ModelState], device: str = "cpu") -> float:
        """What the pool holds: its workers, and on the CPU a running export."""
        held = self.workers_mb(models, device)
        return held + (self.exports().running_mb or 0.0) if device == "cpu" else held

    @staticmethod
    def workers_mb(models: Iterable[ModelState], device: str = "cpu") -> float:
        return sum(m.charge().charged_mb for m in models if m.device == device)

    def view(self, models: Iterable[ModelState]) -> scaling.PoolView:
        """Everything the scaling policy may look at, frozen."""
        models = [m for m in models if m.device is not None]
        devices = {m.device or "cpu" for m in models} | {"cpu", *self.gpu_budgets_mb}
        processes = [w for m in models for w in m.processes()]
        return scaling.PoolView(
            models={m.key: model_view(m) for m in models},
            loading=sum(w.state in LOADING for w in processes),
            max_concurrent_loads=self.config.max_concurrent_loads,
            budget_mb={d: self.budget_for(d) for d in devices},
            # Without a running export: it yields its memory to workers (Plan.stop_export).
            used_mb={d: self.workers_mb(models, d) for d in devices},
            freeing=frozenset(m.device or "cpu" for m in models for w in m.processes()
                              if w.state is WorkerState.STOPPING),
            exports=self.exports())


def model_load(model: ModelState) -> scaling.ModelLoad:
    """The counts of one model the policy decides on; cheap enough for every request."""
    live = model.live_workers()
    return scaling.ModelLoad(
        queued=len(model.queue),
        live=len(live),
        starting=sum(w.state in LOADING for w in live),
        idle=sum(w.state is WorkerState.IDLE and not w.late for w in live),  # late: no work
        busy=sum(w.state is WorkerState.BUSY for w in live),
        max_workers=model.settings.max_workers,
        last_active=model.last_active,
        last_scale_down=model.last_scale_down,
        blocked_until=max(model.failures.blocked_until, model.deaths.blocked_until),
        failed=model.failed,
        warm=model.warm_target,
        awaits_export=model.awaits_export_mb is not None,
    )


def model_view(model: ModelState) -> scaling.ModelView:
    holder = model.holder
    if holder is None or holder.state is WorkerState.DEAD:
        holder_state = "none"
    elif holder.state is WorkerState.STOPPING:
        holder_state = "stopping"
    else:
        holder_state = "holding" if holder.state is WorkerState.HOLDING else "loading"
    return scaling.ModelView(
        key=model.key, load=model_load(model), device=model.device or "cpu",
        charge=model.charge(), uses_holder=model.uses_holder, holder=holder_state,
        idle_workers=tuple((w.worker_id, w.last_used) for w in model.workers.values()
                           if w.state is WorkerState.IDLE and not w.jobs),
        loading_workers=tuple((w.worker_id, w.started_at) for w in model.workers.values()
                              if w.state in LOADING),
        outdated_workers=tuple((w.worker_id, w.state is WorkerState.IDLE and not w.jobs)
                               for w in model.workers.values() if w.outdated and w.ready))
