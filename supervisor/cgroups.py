"""An idle CPU cgroup for workers that are starting, loading or stopping.

Measured on 2 cores (`scripts/bench.py`, `machine_idle_neighbour`): a chain of three
processes passing a request along and back, as a client, the supervisor and a worker do,
has a p99 1.9x higher beside one SCHED_IDLE busy loop than alone, because a task woken
onto the CPU that loop runs on can wait up to a scheduler tick. Beside the same loop as
a normal task in a cgroup marked `cpu.idle` the real daemon's p99 was 1.02x (a SCHED_IDLE
loop: 1.25x): the kernel gives such a group's tasks no more CPU than SCHED_IDLE, but a
woken task does not queue behind them. So, where the cgroup filesystem lets the daemon,
workers are born, load and exit in a `cpu.idle` cgroup made beside its own, and serve in
its own; elsewhere they use SCHED_IDLE (workers/priority.py).

cgroup v1 only for now: under cgroup v2 the daemon would need a cgroup delegated to it
(systemd `Delegate=yes`) turned into a threaded domain, since v2 moves single threads
(the heartbeat) only inside a threaded subtree; that is not built.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

import psutil

from modelpool.protocol.cgroups import LOADING_ENV, SERVING_ENV

log = logging.getLogger("modelpool.cgroups")

GROUP_NAME = re.compile(r"modelpool-(\d+)-loading")


def cpu_cgroup_dir(self_cgroup: str, mountinfo: str) -> Path | None:
    """The directory of this process's cgroup in the cgroup v1 hierarchy that has the cpu
    controller, from /proc/self/cgroup and /proc/self/mountinfo; None without one."""
    path = next((p for _, controllers, p in (line.split(":", 2)
                                             for line in self_cgroup.splitlines())
                 if "cpu" in controllers.split(",")), None)
    if path is None:
        return None
    for line in mountinfo.splitlines():
        fields = line.split()
        after = fields[fields.index("-") + 1:]
        if after[0] == "cgroup" and "cpu" in after[2].split(","):
            root, mount_point = fields[3], fields[4]
            relative = os.path.relpath(path, root)
            return Path(mount_point) if relative == "." else Path(mount_point, relative)
    return None


def own_cpu_cgroup_dir() -> Path | None:
    """This process's cgroup directory in the cgroup v1 cpu hierarchy; None without one."""
    return cpu_cgroup_dir(Path("/proc/self/cgroup").read_text(),
                          Path("/proc/self/mountinfo").read_text())


def loading_cgroup_dir(serving: Path, daemon_pid: int) -> Path:
    return serving / f"modelpool-{daemon_pid}-loading"


def make_loading_cgroup(serving: Path) -> Path:
    """This daemon's loading cgroup beside its own, marked cpu.idle. OSError, and nothing
    left behind, where it cannot be made or marked."""
    loading = loading_cgroup_dir(serving, os.getpid())
    loading.mkdir(exist_ok=True)
    try:
        (loading / "cpu.idle").write_text("1")
    except OSError:  # a kernel before 5.15 has no cpu.idle
        loading.rmdir()
        raise
    return loading


def enter(enabled: bool) -> Path | None:
    """Make this daemon's loading cgroup and name both cgroups in the environment the
    forkserver inherits. None, and workers use SCHED_IDLE, when disabled or not possible."""
    if not enabled:
        return None
    try:
        serving = own_cpu_cgroup_dir()
        if serving is None:
            log.info("no cgroup v1 cpu controller: starting workers run SCHED_IDLE")
            return None
        remove_stale(serving)
        loading = make_loading_cgroup(serving)
    except OSError as exc:
        log.info("cannot make an idle cpu cgroup (%s): starting workers run SCHED_IDLE", exc)
        return None
    os.environ[SERVING_ENV], os.environ[LOADING_ENV] = str(serving), str(loading)
    log.info("starting, loading and stopping workers run in idle cgroup %s", loading)
    return loading


def leave(loading: Path | None) -> None:
    """After the forkserver and every worker have gone."""
    os.environ.pop(SERVING_ENV, None)
    os.environ.pop(LOADING_ENV, None)
    if loading is not None:
        with contextlib.suppress(OSError):  # a process still in it: removed at next start
            loading.rmdir()


def to_normal_priority(pid: int) -> None:
    """The process out of idle priority: into the serving cgroup, and its SCHED_IDLE
    threads to SCHED_OTHER. Nothing for a process that has gone."""
    serving, loading = os.environ.get(SERVING_ENV), os.environ.get(LOADING_ENV)
    if serving and loading:
        with contextlib.suppress(OSError):
            Path(serving, "cgroup.procs").write_text(str(pid))
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):  # a thread that has just exited
                if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                    os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def remove_stale(serving: Path) -> None:
    """Loading cgroups of daemons that are gone (a crash leaves its cgroup behind)."""
    for group in serving.iterdir():
        match = GROUP_NAME.fullmatch(group.name)
        if match and not psutil.pid_exists(int(match[1])):
            with contextlib.suppress(OSError):
                group.rmdir()
