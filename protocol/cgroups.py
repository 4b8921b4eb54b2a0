"""The CPU cgroup that workers start, load and stop in, when the daemon could make one.

The supervisor makes it (supervisor/cgroups.py) and names it, and the cgroup its own
processes run in, to the forkserver through the environment; workers move themselves
between the two (workers/priority.py). Moving a whole process is one write of its pid to
a cgroup's `cgroup.procs`, one thread (cgroup v1 only) a write of its id to `tasks`.
"""

from __future__ import annotations

import os

LOADING_ENV = "MODELPOOL_LOADING_CGROUP"
SERVING_ENV = "MODELPOOL_SERVING_CGROUP"


def move_process(group_dir: str) -> None:
    """This process, every thread of it, into the cgroup at group_dir."""
    with open(os.path.join(group_dir, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))


def move_thread(group_dir: str, tid: int) -> None:
    with open(os.path.join(group_dir, "tasks"), "w") as tasks:
        tasks.write(str(tid))
