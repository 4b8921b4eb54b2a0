"""The supervisor's one clock: `now` for every timestamp, `call_later` for every timer.

The pool, the job book, the launcher and shutdown take a Scheduler instead of reading
time or arming loop timers themselves, so policy tests drive time with a fake one and
never sleep.
"""

from __future__ import annotations

import asyncio
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
