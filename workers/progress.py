"""How far a load has got, as the supervisor sees it from outside: a number that moves
while the loading thread reads bytes (weight files, a download) or computes, and stands
still when it is stuck (a hung download, a wedged file system: no bytes, no CPU).

The main thread loads; the heartbeat thread reads this and sends it. Only the main
thread's CPU time counts, so the heartbeat thread's own wake-ups never look like
progress, and the bytes this module reads from /proc are taken off again.
"""

from __future__ import annotations

import os

_own_reads = 0  # bytes load_progress itself has read, which /proc/self/io counts too


def load_progress() -> int:
    """Bytes this process has read plus the main thread's CPU ticks; 0 if unreadable."""
    global _own_reads
    try:
        io = _read("/proc/self/io")
        stat = _read(f"/proc/self/task/{os.getpid()}/stat")  # the main thread's
    except OSError:
        return 0
    rchar = next((int(line.split()[1]) for line in io.splitlines()
                  if line.startswith(b"rchar:")), 0)
    fields = stat.rsplit(b")", 1)[1].split()
    progress = rchar - _own_reads + int(fields[11]) + int(fields[12])  # + utime, stime
    _own_reads += len(io) + len(stat)
    return progress


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)  # one read: each is counted in rchar exactly once
    finally:
        os.close(fd)
