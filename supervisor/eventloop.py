"""Which asyncio event loop the daemon's processes run on: uvloop (libuv's loop, the
standard fast drop-in for asyncio's) where it is installed, else asyncio's own; and how
a process ends once its loop has stopped.

Each wake of the loop is most of what a lone request costs the supervisor: with asyncio's
loop an echo over a Unix socket took ~45 us of CPU per round trip on the 2-core test
machine, with uvloop ~16-20 (a blocking loop with no event loop at all, ~10).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

EventLoop = Literal["auto", "uvloop", "asyncio"]
T = TypeVar("T")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def loop_factory(choice: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for the loop chosen; None for asyncio's default. ("uvloop" without
    uvloop installed is refused when the config is read.)"""
    if choice == "asyncio" or not uvloop_installed():
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: EventLoop) -> T:
    """asyncio.run(main) on the loop chosen."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def running_loop_name() -> str:
    """"uvloop" or "asyncio", for the log line that says the daemon is serving."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"


def exit_without_teardown(code: int) -> int:
    """End a process whose loop has stopped (the daemon, the HTTP front door) as Python's
    exit would (its exit handlers run: logs flushed, multiprocessing's finalizers), but
    without that exit's last step, freeing its objects one by one and module by module:
    90-160 ms of every stop of the daemon here, which nothing needs (the kernel takes
    the memory back whole). While a thread of its own still runs, Python's exit, which
    waits for it, is left to do it all."""
    if any(thread is not threading.main_thread() and not thread.daemon
           for thread in threading.enumerate()):
        return code
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
