"""The supervisor's one clock: `now` for every timestamp, `call_later` for every timer.

The pool, the job book, the launcher and shutdown take a Scheduler instead of reading
time or arming loop timers themselves, so policy tests drive time with a fake one and
never sleep.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

E = TypeVar("E", bound="Expiring")


class Timer(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    def now(self) -> float:
        """Monotonic seconds: every duration and timestamp in the supervisor."""

    def wall(self) -> float:
        """Seconds since the epoch: only to count a deadline from the client's clock."""

    def call_later(self, delay_s: float, callback: Callable[..., object], *args: Any) -> Timer:
        """Run callback(*args) on the event loop after delay_s."""


class LoopScheduler:
    """The real one: the event loop's monotonic clock and its timers."""

    # The builtins themselves, not methods that call them: read on every request.
    now = staticmethod(time.monotonic)  # what the event loop's own clock reads
    wall = staticmethod(time.time)

    def call_later(self, delay_s: float, callback: Callable[..., object], *args: Any) -> Timer:
        return asyncio.get_running_loop().call_later(delay_s, callback, *args)


async def wait_for(scheduler: Scheduler, event: asyncio.Event, deadline: float) -> bool:
    """Wait until the event is set (True) or the scheduler's clock reaches deadline."""
    if event.is_set():
        return True
    if deadline <= scheduler.now():
        return False
    loop = asyncio.get_running_loop()
    expired: asyncio.Future[None] = loop.create_future()
    timer = scheduler.call_later(deadline - scheduler.now(),
                                 lambda: expired.done() or expired.set_result(None))
    waiter = loop.create_task(event.wait())
    try:
        await asyncio.wait({waiter, expired}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        waiter.cancel()
        expired.cancel()
    return event.is_set()


class Expiring(Protocol):
    done: bool  # true once it ended some other way: it no longer falls due


class ExpiryHeap(Generic[E]):
    """Many things that fall due unless done first, nearly all done long before (every
    request's timeout): kept in one heap, with one scheduler timer armed for the
    earliest. The thing is its own timer, and done means cancelled: nothing is made or
    cancelled per request (a loop timer each was ~7% of the supervisor's time, a timer
    object ~3%). Done entries are dropped as they reach the top, and all at once when
    the heap has doubled since, so it holds about twice what is waiting at most."""

    SWEEP_FROM = 1024  # entries below which the heap is never swept

    def __init__(self, scheduler: Scheduler, on_due: Callable[[E, float], object]) -> None:
        self.scheduler = scheduler
        self.on_due = on_due  # (the thing, the time it fell due at)
        self._heap: list[tuple[float, int, E]] = []
        self._order = 0
        self._sweep_at = self.SWEEP_FROM
        self._armed: Timer | None = None
        self._armed_at = math.inf

    def add(self, when: float, item: E) -> None:
        """`item` falls due at `when`, a time on the scheduler's clock, unless done."""
        self._order += 1
        heapq.heappush(self._heap, (when, self._order, item))
        if len(self._heap) > self._sweep_at:
            self._heap = [entry for entry in self._heap if not entry[2].done]
            heapq.heapify(self._heap)
            self._sweep_at = max(self.SWEEP_FROM, 2 * len(self._heap))
        if when < self._armed_at:
            self._arm(when)

    def __len__(self) -> int:
        return len(self._heap)

    def _arm(self, when: float) -> None:
        if self._armed is not None:
            self._armed.cancel()
        self._armed, self._armed_at = None, math.inf
        if math.isfinite(when):
            self._armed = self.scheduler.call_later(when - self.scheduler.now(), self._fire)
            self._armed_at = when

    def _fire(self) -> None:
        self._armed, self._armed_at = None, math.inf
        # The loop may run a timer up to its clock's resolution early.
        until = self.scheduler.now() + 1e-6
        # self._heap, not a local: an on_due's add may sweep it.
        while self._heap and (self._heap[0][0] <= until or self._heap[0][2].done):
            when, _, item = heapq.heappop(self._heap)
            if not item.done:
                self.on_due(item, when)
        self._arm(self._heap[0][0] if self._heap else math.inf)
