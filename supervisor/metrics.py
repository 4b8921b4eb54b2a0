"""Per-model counters: per priority with recent latencies, for `modelpool status`; and
cumulative totals and histograms, for monitoring (GET /metrics)."""

from __future__ import annotations

import bisect
import collections
import itertools
from dataclasses import dataclass, field
from typing import Any

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.fields import PRIORITIES
from modelpool.protocol.messages import End, Error
from modelpool.protocol.status import PriorityStats
from modelpool.protocol.totals import HistogramTotals, ModelTotals, OutcomeCount

LATENCY_WINDOW = 1000  # recent completions kept per priority for percentiles
# Prometheus' default buckets, widened at both ends: a cached embedding answers in
# under a millisecond, a long generation takes minutes.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Histogram:
    """Fixed buckets: one count per observation, on every request; made cumulative, as
    Prometheus has them, only when read."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.in_bucket = [0] * (len(bounds) + 1)  # the last: above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        self.in_bucket[bisect.bisect_left(self.bounds, value)] += 1

    def totals(self) -> HistogramTotals:
        return HistogramTotals(bounds=list(self.bounds),
                               counts=list(itertools.accumulate(self.in_bucket[:-1])),
                               count=self.count, sum=self.sum)


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
    outcomes: collections.Counter[tuple[str, str, str]] = field(
        default_factory=collections.Counter)  # (op, priority, "OK" or error code)
    latency_s: dict[str, Histogram] = field(default_factory=dict)  # by op
    queue_wait_s: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    loads: int = 0
    load_failures: int = 0
    worker_deaths: int = 0
    # a stream's counts, per request answered
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, from the workers' prefix caches
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, reasoning models' thinking

    def batch(self, size: int) -> None:
        """A batch of `size` went to a worker (each job's wait is in queue_wait_s)."""
        self.batches += 1
        self.batched_items += size
        self.batch_size.observe(size)

    def rejected(self, op: str, priority: str, code: ErrorCode) -> None:
        self.by_priority[priority].rejected[code.value] += 1
        self.outcomes[op, priority, code.value] += 1

    def ended(self, op: str, priority: str, reply: Any, latency_s: float) -> None:
        """One request's final reply; None when its client left without one."""
        if reply is None:
            return  # nobody to count it for
        failed = type(reply) is Error
        if type(reply) is End:
            self.prompt_tokens += reply.prompt_tokens
            self.cached_tokens += reply.cached_tokens
            self.completion_tokens += reply.completion_tokens
            self.reasoning_tokens += reply.reasoning_tokens
        self.outcomes[op, priority, reply.code.value if failed else "OK"] += 1
        histogram = self.latency_s.get(op)
        if histogram is None:
            histogram = self.latency_s[op] = Histogram(SECONDS_BUCKETS)
        histogram.observe(latency_s)
        counters = self.by_priority[priority]
        if not failed:
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


    def totals(self) -> ModelTotals:
        return ModelTotals(
            outcomes=[OutcomeCount(op=op, priority=p, code=code, count=n)
                      for (op, p, code), n in self.outcomes.items()],
            latency_s={op: h.totals() for op, h in self.latency_s.items()},
            queue_wait_s=self.queue_wait_s.totals(), batch_size=self.batch_size.totals(),
            loads=self.loads, load_failures=self.load_failures,
            worker_deaths=self.worker_deaths, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=self.completion_tokens,
            reasoning_tokens=self.reasoning_tokens)


def _percentile_ms(sorted_s: list[float], q: float) -> float | None:
    if not sorted_s:
        return None
    return round(sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] * 1000, 3)
