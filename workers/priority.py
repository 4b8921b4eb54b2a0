"""Workers are born, load and exit at idle CPU priority, and serve as batch tasks, so
that starting, loading or stopping one slows the models that are serving as little as
the kernel allows.

Measured on 2 cores: a freshly forked worker spends ~15 ms of CPU (copy-on-write faults,
multiprocessing's bootstrap) before any code of ours could lower its priority, and a
niced load still holds its CPU slice when a serving process wakes. So the forkserver
puts itself in SCHED_IDLE once its imports are done: every worker is forked idle, and
any normal task preempts it at once. At Ready every thread goes to SCHED_BATCH at the
original nice value: same CPU share, but a worker woken with work no longer preempts
the supervisor or a client on their way to sleep. The heartbeat thread goes back to
normal first thing, so a slow load on a busy machine still beats on time.

Going back needs CAP_SYS_NICE or an RLIMIT_NICE that allows the original nice value
(systemd: LimitNICE=+0); without either nothing is lowered, rather than leave a worker
slow forever. Scheduling policies and nice values are per thread on Linux.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading

_restore_nice: int | None = None  # set in the forkserver, inherited by every worker


def can_restore(nice: int) -> bool:
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - nice <= soft


def lower() -> bool:
    """This thread, and every thread or process it starts from now on, to idle priority.
    Called in the forkserver; False when it could not be undone and so was not done."""
    global _restore_nice
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if not can_restore(nice):
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    _restore_nice = nice
    return True


def restore_this_thread() -> None:
    if _restore_nice is not None:
        _set(threading.get_native_id(), _restore_nice, os.SCHED_OTHER)


def restore_all_threads() -> None:
    """Every thread to serving priority (torch may have started its pool, idle too)."""
    if _restore_nice is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has just exited
            _set(int(tid), _restore_nice, os.SCHED_BATCH)


def idle_all_threads() -> None:
    """For tearing down (whichever thread exits last frees the address space): an exit
    must not slow the serving workers either. Always allowed."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _set(tid: int, nice: int, policy: int) -> None:
    os.sched_setscheduler(tid, policy, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, nice)
