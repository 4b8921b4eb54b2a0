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

Where the supervisor made an idle CPU cgroup (supervisor/cgroups.py), that replaces
SCHED_IDLE: a task woken onto a CPU where a SCHED_IDLE task runs can wait a whole
scheduler tick, one that queues behind a task of an idle cgroup does not. Workers then
move between the two cgroups instead, and keep normal scheduling until Ready; if a move
fails, SCHED_IDLE again.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading

from modelpool.protocol.cgroups import LOADING_ENV, SERVING_ENV, move_process, move_thread

_restore_nice: int | None = None  # set in the forkserver, inherited by every worker
_cgroups: tuple[str, str] | None = None  # (serving, loading) dirs, likewise


def can_restore(nice: int) -> bool:
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - nice <= soft


def lower() -> bool:
    """This thread, and every thread or process it starts from now on, to idle priority.
    Called in the forkserver; False when it could not be undone and so was not done."""
    global _restore_nice, _cgroups
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    serving, loading = os.environ.get(SERVING_ENV), os.environ.get(LOADING_ENV)
    if serving and loading and _moved(loading):  # no nice value changes: always undone
        _cgroups = serving, loading
    elif can_restore(nice):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        return False
    _restore_nice = nice
    return True


def restore_this_thread() -> None:
    if _restore_nice is None:
        return
    tid = threading.get_native_id()
    if _cgroups is not None:
        with contextlib.suppress(OSError):  # then it stays with its process
            move_thread(_cgroups[0], tid)
    _set(tid, _restore_nice, os.SCHED_OTHER)


def restore_all_threads() -> None:
    """Every thread to serving priority (torch may have started its pool, idle too)."""
    if _restore_nice is None:
        return
    if _cgroups is not None:
        _moved(_cgroups[0])  # if not, this worker serves from the idle cgroup
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has just exited
            _set(int(tid), _restore_nice, os.SCHED_BATCH)


def idle_all_threads() -> None:
    """For tearing down (whichever thread exits last frees the address space): an exit
    must not slow the serving workers either. Always allowed."""
    if _cgroups is not None and _moved(_cgroups[1]):
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _moved(group_dir: str) -> bool:
    try:
        move_process(group_dir)
    except OSError:
        return False
    return True


def _set(tid: int, nice: int, policy: int) -> None:
    os.sched_setscheduler(tid, policy, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, nice)
