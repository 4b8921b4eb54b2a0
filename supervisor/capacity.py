"""How much the pool may grow: load slots, the CPU plan, and the memory budget with
eviction of idle workers. Owned by the Pool; runs on the same event loop."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from modelpool.supervisor import memory, scaling
from modelpool.supervisor.config import PoolConfig
from modelpool.supervisor.gpus import Gpu
from modelpool.supervisor.workers import Launcher, WorkerHandle, WorkerState

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelState

log = logging.getLogger("modelpool.capacity")


class Capacity:
    def __init__(self, models: dict[str, ModelState], config: PoolConfig,
                 launcher: Launcher, gpus: list[Gpu]) -> None:
        self.models = models
        self.config = config
        self.launcher = launcher
        self.cpus = os.cpu_count() or 1
        self.budget_mb = (config.memory_budget_mb
                          or config.memory_fraction * memory.read_memory().total_mb)
        self.gpu_budgets_mb = {g.device: config.memory_fraction * g.total_mb for g in gpus}

    def budget_for(self, device: str) -> float:
        """memory_fraction x RAM for the CPU, x VRAM for each GPU."""
        return self.budget_mb if device == "cpu" else self.gpu_budgets_mb.get(device, 0.0)

    def load_view(self, model: ModelState) -> scaling.ModelLoad:
        live = model.live_workers()
        return scaling.ModelLoad(
            queued=len(model.queue),
            live=len(live),
            starting=sum(w.state in (WorkerState.STARTING, WorkerState.LOADING) for w in live),
            idle=sum(w.state is WorkerState.IDLE for w in live),
            busy=sum(w.state is WorkerState.BUSY for w in live),
            max_workers=self.cpu_plan(model)[1],
            last_active=model.last_active,
            last_scale_down=model.last_scale_down,
            blocked_until=model.blocked_until,
            failed=model.load_failures >= self.config.max_load_failures,
            warm=model.warm_target,
        )

    def cpu_plan(self, model: ModelState) -> tuple[int, int]:
        """(threads per worker, max workers) for this model."""
        return scaling.cpu_plan(
            self.cpus, self.config.cold_start_workers,
            model.spec.threads or self.config.threads_per_worker,
            model.spec.max_workers or self.config.max_workers_per_model)

    def room(self, model: ModelState) -> int:
        """Workers that may start now: load slots free, and memory (evicting if needed)."""
        loading = sum(w.state in (WorkerState.STARTING, WorkerState.LOADING)
                      for m in self.models.values() for w in m.processes())
        load_slots = self.config.max_concurrent_loads - loading
        if load_slots <= 0:
            return 0
        charge = self.charge(model)
        room = memory.room_for(charge, self.used_mb(model.device),
                               self.budget_for(model.device))
        model.waiting_for_memory = room == 0
        if room == 0:
            self.evict_for(model, charge)
        return min(load_slots, room)

    def evict_for(self, model: ModelState, charge: memory.ModelCharge) -> None:
        """Stop idle workers of other models, least recently used first, to make room."""
        workers = [w for m in self.models.values() for w in m.processes()]
        if any(w.state is WorkerState.STOPPING for w in workers):
            return  # memory is already being freed; decide again when those workers exit
        candidates = []
        for other in self.models.values():
            if other is model or len(other.queue) or other.device != model.device:
                continue  # only an idle model on the same device frees what is needed
            other_charge = self.charge(other)
            candidates += [
                memory.EvictionCandidate(w.worker_id, other.spec.key, w.last_used,
                                         other_charge.per_worker_mb, other_charge.weights_mb,
                                         other_charge.workers, other_charge.shared_weights)
                for w in other.workers.values() if w.state is WorkerState.IDLE and not w.jobs]
        free = self.budget_for(model.device) - self.used_mb(model.device)
        need = charge.next_worker_mb - free
        for worker_id in memory.pick_evictions(candidates, need):
            victim = next(w for w in workers if w.worker_id == worker_id)
            log.info("evicting idle worker %d of %s to make room for %s", worker_id,
                     victim.model_key, model.spec.key)
            self.launcher.stop(victim, self.config.shutdown_timeout_s + 1)

    def charge(self, model: ModelState) -> memory.ModelCharge:
        spec = model.spec
        weights = model.measured_weights_mb
        per_worker = model.measured_per_worker_mb
        return memory.ModelCharge(
            weights_mb=spec.weights_mb if weights is None else weights,
            per_worker_mb=spec.per_worker_mb if per_worker is None else per_worker,
            workers=sum(w.state is not WorkerState.DEAD for w in model.workers.values()),
            shared_weights=model.device == "cpu" or model.uses_holder,
            held=model.holder is not None)

    def used_mb(self, device: str = "cpu") -> float:
        return sum(self.charge(m).charged_mb for m in self.models.values()
                   if m.device == device)

    def note_uss(self, model: ModelState, worker: WorkerHandle, uss_mb: float | None) -> None:
        """A worker's measured private memory replaces the registry's estimate."""
        if uss_mb is None:
            return
        worker.uss_mb = uss_mb
        if model.device == "cpu":  # a GPU worker is charged its VRAM, see note_vram
            model.measured_per_worker_mb = max(model.measured_per_worker_mb or 0.0, uss_mb)

    def note_vram(self, model: ModelState, vram_mb: float | None) -> None:
        """A GPU worker's reserved VRAM replaces the per-worker estimate. Without a weights
        holder that includes its own copy of the weights, so they are not charged apart."""
        if vram_mb is None or model.device == "cpu":
            return
        if not model.uses_holder:
            model.measured_weights_mb = 0.0
        model.measured_per_worker_mb = max(model.measured_per_worker_mb or 0.0, vram_mb)
