"""Per-model, per-priority counters and recent latencies, for `modelpool status`."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import PRIORITIES, Error, PriorityStats

LATENCY_WINDOW = 1000  # recent completions kept per priority for percentiles


@dataclass
class PriorityCounters:
    completed: int = 0
    failed: int = 0
    expired: int = 0
    deduplicated: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies_s: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW))


@dataclass
class ModelMetrics:
    by_priority: dict[str, PriorityCounters] = field(
        default_factory=lambda: {p: PriorityCounters() for p in PRIORITIES})
    batches: int = 0
    batched_items: int = 0
    service_s: float = 0.0  # moving average of a dispatch's run time, for retry hints

    def batch(self, size: int) -> None:
        self.batches += 1
        self.batched_items += size

    def ended(self, priority: str, reply: Any, latency_s: float) -> None:
        """One request's final reply; None when its client left without one."""
        counters = self.by_priority[priority]
        if reply is None:
            return  # nobody to count it for
        if not isinstance(reply, Error):
            counters.completed += 1
            counters.latencies_s.append(latency_s)
        elif reply.code is ErrorCode.DEADLINE_EXPIRED:
            counters.expired += 1
        else:
            counters.failed += 1

    def ran(self, seconds: float) -> None:
        self.service_s = seconds if not self.service_s else 0.9 * self.service_s + 0.1 * seconds

    @property
    def mean_batch(self) -> float:
        return self.batched_items / self.batches if self.batches else 0.0

    def snapshot(self, queued: dict[str, int], running: dict[str, int]) -> list[PriorityStats]:
        out = []
        for name, c in self.by_priority.items():
            lat = sorted(c.latencies_s)
            if not (lat or c.failed or c.rejected or queued.get(name) or running.get(name)):
                continue
            out.append(PriorityStats(
                priority=name, queued=queued.get(name, 0), running=running.get(name, 0),
                completed=c.completed, failed=c.failed, expired=c.expired,
                deduplicated=c.deduplicated, rejected=dict(c.rejected),
                p50_ms=_percentile_ms(lat, 0.50), p99_ms=_percentile_ms(lat, 0.99)))
        return out


def _percentile_ms(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return round(sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000, 3)
