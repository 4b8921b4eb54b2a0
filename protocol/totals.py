"""A model's counters since the daemon started, as status carries them for monitoring
(GET /metrics): outcomes by operation, priority and code, and histograms."""

from __future__ import annotations

import msgspec


class HistogramTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Cumulative since start, as Prometheus keeps them: counts[i] observations were at
    most bounds[i] (the last count, +Inf, is `count`)."""

    bounds: list[float]
    counts: list[int]
    count: int = 0
    sum: float = 0.0


class OutcomeCount(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    op: str
    priority: str
    code: str  # "OK" or the ErrorCode
    count: int


class ModelTotals(msgspec.Struct, frozen=True, kw_only=True):
    """A model's counters since the daemon started, for monitoring (GET /metrics)."""

    outcomes: list[OutcomeCount] = []
    latency_s: dict[str, HistogramTotals] = {}  # by op: accepted -> final reply
    queue_wait_s: HistogramTotals | None = None  # accepted -> sent to a worker
    batch_size: HistogramTotals | None = None
    loads: int = 0  # workers that became ready
    load_failures: int = 0
    worker_deaths: int = 0  # serving workers that exited unasked
    prompt_tokens: int = 0  # of the streams answered (text_to_text, vision)
    cached_tokens: int = 0  # of prompt_tokens, taken from the workers' prefix caches
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, reasoning models' thinking
