"""The memory budget: memory_fraction x RAM, charged per model from registry estimates
(replaced by a worker's measured USS once it has loaded)."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class MemoryFacts:
    total_mb: float
    available_mb: float


def read_memory() -> MemoryFacts:
    vm = psutil.virtual_memory()
    return MemoryFacts(total_mb=vm.total / 2**20, available_mb=vm.available / 2**20)


def worker_cost_mb(weights_mb: float, per_worker_mb: float, measured_uss_mb: float | None) -> float:
    """What one more worker of a model costs. Each worker holds its own weights for now;
    a measured USS (weights included) beats the registry's estimate."""
    if measured_uss_mb is not None:
        return measured_uss_mb
    return weights_mb + per_worker_mb


def room_for(cost_mb: float, used_mb: float, budget_mb: float) -> int:
    """How many workers of this cost still fit the budget."""
    if cost_mb <= 0:
        return 1 << 16
    return max(0, int((budget_mb - used_mb) // cost_mb))
