"""Optionally run the supervisor's event loop as a real-time (SCHED_FIFO) thread.

Every request passes through this one thread twice, and on a small machine it is woken
onto CPUs that are busy starting, loading or stopping workers. Traced on 2 cores, it
then waited over 1 ms for ~10% of requests, up to a 4 ms scheduler tick, even though
those workers run at idle priority; as SCHED_FIFO it waited that long once in 8 s. Off
by default: a real-time thread is something an administrator grants (root,
CAP_SYS_NICE, or an RLIMIT_RTPRIO of at least 1). The lowest real-time priority is
enough to come before every normal task; the kernel's real-time throttling still keeps
a share of each CPU for everything else.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("modelpool.realtime")

FIFO_PRIORITY = 1


def enter_realtime() -> bool:
    """This thread to SCHED_FIFO; threads and processes it starts from now on do not
    inherit it (SCHED_RESET_ON_FORK): executor threads, the forkserver and so every
    worker keep normal scheduling. False, and a warning, when not permitted."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                              os.sched_param(FIFO_PRIORITY))
    except PermissionError:
        log.warning("realtime = true, but this process may not use SCHED_FIFO (needs root, "
                    "CAP_SYS_NICE or LimitRTPRIO=1): the event loop runs at normal priority")
        return False
    log.info("event loop runs SCHED_FIFO, priority %d", FIFO_PRIORITY)
    return True


def follow(wanted: bool) -> None:
    """A reloaded `realtime`: into SCHED_FIFO, or back to normal scheduling (keeping
    SCHED_RESET_ON_FORK, which only a privileged thread may clear)."""
    if wanted:
        enter_realtime()
        return
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    except PermissionError as exc:
        log.warning("realtime = false, but the event loop could not leave SCHED_FIFO: %s", exc)
        return
    log.info("event loop runs at normal priority")
