"""Loading at low CPU priority, so a load never slows the models that are serving.

Linux nice values are per thread: the loading thread is niced, and afterwards every
thread of the worker (torch may have started its pool during the load) is set back.
Going back needs CAP_SYS_NICE or an RLIMIT_NICE that allows it (systemd: LimitNICE=+0);
without either, loads run at normal priority rather than leave a worker slow forever.
"""

from __future__ import annotations

import contextlib
import os
import resource

LOAD_NICENESS = 10


def can_restore(nice: int) -> bool:
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - nice <= soft


def lower() -> int | None:
    """Lower this thread's priority for the load; returns what to restore, or None when
    it could not be restored and so was not lowered."""
    original = os.getpriority(os.PRIO_PROCESS, 0)
    if not can_restore(original):
        return None
    os.setpriority(os.PRIO_PROCESS, 0, min(19, original + LOAD_NICENESS))
    return original


def restore(original: int | None) -> None:
    """Every thread back to the original priority (threads started since inherited ours)."""
    if original is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), original)
