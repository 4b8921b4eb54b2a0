"""Each HTTP client's requests a minute (`[http] requests_per_minute`), as OpenAI limits
them: a bucket per client (its API key, else its address) that holds a minute's requests
and fills again at that rate; a request takes one, and one that finds it empty is
answered 429 with how long until one is there. Pure: the time comes from the caller.

Buckets are kept for the clients seen last, at most MAX_CLIENTS: one dropped was full or
long unused, and starts full again, which is what a minute's wait would have given it."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

MAX_CLIENTS = 65536


@dataclass(frozen=True)
class Taken:
    allowed: bool
    remaining: int  # whole requests left in the bucket
    reset_s: float  # until the bucket is full again
    retry_after_s: float  # until a request may be taken (0 if allowed)

    def headers(self, limit: int) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (and Retry-After when refused)."""
        headers = {"x-ratelimit-limit-requests": str(limit),
                   "x-ratelimit-remaining-requests": str(self.remaining),
                   "x-ratelimit-reset-requests": f"{self.reset_s:.3f}s"}
        if not self.allowed:
            ms = math.ceil(round(self.retry_after_s * 1000, 6))  # (not 20.000000001 s)
            headers["retry-after"] = str(max(1, math.ceil(ms / 1000)))
            headers["retry-after-ms"] = str(ms)
        return headers


class RateLimits:
    def __init__(self, max_clients: int = MAX_CLIENTS) -> None:
        self.max_clients = max_clients
        # client -> (requests in its bucket, when it was counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, who: str, per_minute: int, now: float) -> Taken:
        """One request of `who`'s, if its bucket holds one."""
        rate = per_minute / 60.0
        level, at = self._buckets.pop(who, (float(per_minute), now))
        level = min(float(per_minute), level + (now - at) * rate)
        allowed = level >= 1.0
        if allowed:
            level -= 1.0
        self._buckets[who] = (level, now)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)  # the least recently seen
        return Taken(allowed, int(level), (per_minute - level) / rate,
                     0.0 if allowed else (1.0 - level) / rate)
