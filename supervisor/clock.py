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
from typing import Any, Protocol


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


class TimerHeap:
    """Many timers that are nearly all cancelled long before they fall due (every
    request's timeout): kept in one heap, with one scheduler timer armed for the
    earliest. Arming a loop timer per request, and cancelling it, was ~7% of the
    supervisor's time per request; here it is a tuple pushed and a flag set. Cancelled
    entries are dropped as they reach the top, and all at once when they are over half
    the heap, so it holds at most about twice the live timers."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._heap: list[tuple[float, int, HeapTimer]] = []
        self._order = 0
        self._armed: Timer | None = None
        self._armed_at = math.inf
        self.cancelled = 0

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> HeapTimer:
        """At `when`, a time on the scheduler's clock."""
        timer = HeapTimer(self, callback, args)
        self._order += 1
        heapq.heappush(self._heap, (when, self._order, timer))
        if when < self._armed_at:
            self._arm(when)
        return timer

    def __len__(self) -> int:
        return len(self._heap)

    def _cancelled_one(self) -> None:
        self.cancelled += 1
        if self.cancelled > 64 and 2 * self.cancelled > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].cancelled]
            heapq.heapify(self._heap)
            self.cancelled = 0

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
        # self._heap, not a local: a callback's cancel may rebuild it.
        while self._heap and (self._heap[0][0] <= until or self._heap[0][2].cancelled):
            _, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                self.cancelled -= 1
            else:
                timer.fired = True
                timer.callback(*timer.args)
        self._arm(self._heap[0][0] if self._heap else math.inf)


class HeapTimer:
    __slots__ = ("args", "callback", "cancelled", "fired", "heap")

    def __init__(self, heap: TimerHeap, callback: Callable[..., object],
                 args: tuple[Any, ...]) -> None:
        self.heap = heap
        self.callback = callback
        self.args = args
        self.cancelled = False
        self.fired = False

    def cancel(self) -> None:
        if not (self.cancelled or self.fired):
            self.cancelled = True
            self.args = ()  # what it would have called with is freed now, not when dropped
            self.heap._cancelled_one()
