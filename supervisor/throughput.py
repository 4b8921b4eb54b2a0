"""Tokens a second, from the running total each worker's heartbeat carries: what
`status` shows per worker and per model for generation."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

WINDOW_S = 5.0  # the rate is over the heartbeats of about this long


@dataclass
class TokenRate:
    """A worker's generated-token total over its recent heartbeats."""

    samples: collections.deque[tuple[float, int]] = field(
        default_factory=lambda: collections.deque(maxlen=64))
    total: int = 0  # tokens generated since the worker started

    def note(self, now: float, tokens: int) -> None:
        self.total = tokens
        self.samples.append((now, tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= WINDOW_S:
            self.samples.popleft()

    def per_s(self, now: float) -> float:
        """Over the last WINDOW_S or so; 0 once the heartbeats stop coming."""
        if len(self.samples) < 2 or now - self.samples[-1][0] > WINDOW_S:
            return 0.0
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
