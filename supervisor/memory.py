"""The memory budget: memory_fraction x RAM, and what each model is charged against it.

A model costs its weights once when its workers share them (on the CPU they map the
same weight files, whose size the workers report; with a weights holder they map the
holder's, which the holder reports) plus each worker's private memory. Registry
estimates are used until a worker has loaded and been measured.
Pure functions: the pool passes in the numbers.
"""

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


@dataclass(frozen=True)
class ModelCharge:
    weights_mb: float
    per_worker_mb: float
    workers: int  # workers holding memory: every one not yet dead, stopping ones included
    shared_weights: bool = True  # CPU or a weights holder: one copy; else a copy per worker
    held: bool = False  # a weights holder process is alive and holds the one copy

    @property
    def charged_mb(self) -> float:
        copies = (1 if self.workers or self.held else 0) if self.shared_weights else self.workers
        return copies * self.weights_mb + self.workers * self.per_worker_mb

    @property
    def next_worker_mb(self) -> float:
        """What one more worker adds: the weights too when it is the first (and no holder
        has them already), or when workers cannot share them."""
        own_weights = not self.shared_weights or not (self.workers or self.held)
        return self.per_worker_mb + (self.weights_mb if own_weights else 0.0)


def never_fits(charge: ModelCharge, budget_mb: float) -> bool:
    """Even alone, one worker of this model exceeds the whole budget."""
    return charge.weights_mb + charge.per_worker_mb > budget_mb


def room_for(charge: ModelCharge, used_mb: float, budget_mb: float) -> int:
    """How many more workers of this model fit in what the budget has left."""
    free = budget_mb - used_mb
    first = charge.next_worker_mb
    if free < first:
        return 0
    if charge.per_worker_mb <= 0:
        return 1 << 16
    return 1 + int((free - first) // charge.per_worker_mb)


@dataclass(frozen=True)
class EvictionCandidate:
    worker_id: int
    model_key: str
    last_used: float
    per_worker_mb: float
    weights_mb: float
    model_workers: int  # workers of that model holding memory, this one included
    shared_weights: bool = True


def pick_evictions(candidates: list[EvictionCandidate], need_mb: float) -> list[int]:
    """Least recently used idle workers whose exit frees at least need_mb, or [] when even
    all of them would not be enough (evicting then would only hurt)."""
    chosen: list[int] = []
    freed = 0.0
    remaining: dict[str, int] = {}
    for cand in sorted(candidates, key=lambda c: c.last_used):
        if freed >= need_mb:
            break
        left = remaining.get(cand.model_key, cand.model_workers) - 1
        remaining[cand.model_key] = left
        frees_weights = left == 0 or not cand.shared_weights
        freed += cand.per_worker_mb + (cand.weights_mb if frees_weights else 0.0)
        chosen.append(cand.worker_id)
    return chosen if freed >= need_mb else []
