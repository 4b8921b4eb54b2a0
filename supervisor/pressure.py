"""Memory that follows the machine: the budget from the cgroup's limit and from what other
processes leave available, re-read periodically; idle workers evicted when outside
pressure shrinks it below what the pool holds; and a worker the kernel's OOM killer
took, told apart from other deaths.

Reading the files is done here once per refresh; the decisions (`effective_budget`,
`plan_relief`, `exit_cause`) are pure functions of what was read, tested with made-up
figures and a fake clock.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from modelpool.supervisor import memory, scaling
from modelpool.workers import exitcodes

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True)
class CgroupMemory:
    limit_mb: float | None  # memory.max (v2) or memory.limit_in_bytes (v1); None: none
    usage_mb: float | None  # memory.current / memory.usage_in_bytes
    oom_kills: int | None  # memory.events / memory.oom_control: oom_kill


def memory_cgroup_dir(self_cgroup: str, mountinfo: str) -> Path | None:
    """This process's memory cgroup directory: the v1 hierarchy with the memory
    controller if there is one, else the v2 unified hierarchy."""
    entries = [line.split(":", 2) for line in self_cgroup.splitlines() if line.count(":") >= 2]
    v1 = next((p for _, ctl, p in entries if "memory" in ctl.split(",")), None)
    v2 = next((p for hid, ctl, p in entries if hid == "0" and ctl == ""), None)
    for line in mountinfo.splitlines():
        fields = line.split()
        after = fields[fields.index("-") + 1:]
        if v1 is not None and after[0] == "cgroup" and "memory" in after[2].split(","):
            return _join(fields[4], fields[3], v1)
        if v1 is None and v2 is not None and after[0] == "cgroup2":
            return _join(fields[4], fields[3], v2)
    return None


def _join(mount_point: str, root: str, path: str) -> Path:
    relative = os.path.relpath(path, root)
    return Path(mount_point) if relative == "." else Path(mount_point, relative)


def read_cgroup(directory: Path | None) -> CgroupMemory:
    if directory is None:
        return CgroupMemory(None, None, None)
    limit = _number(directory, "memory.max") or _number(directory, "memory.limit_in_bytes")
    usage = _number(directory, "memory.current") or _number(directory, "memory.usage_in_bytes")
    kills = (_field(directory / "memory.events", "oom_kill")
             if (directory / "memory.events").exists()
             else _field(directory / "memory.oom_control", "oom_kill"))
    return CgroupMemory(limit / 2**20 if limit and limit < UNLIMITED else None,
                        usage / 2**20 if usage is not None else None, kills)


def own_cgroup() -> Path | None:
    try:
        return memory_cgroup_dir(Path("/proc/self/cgroup").read_text(),
                                 Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None


def _number(directory: Path, name: str) -> int | None:
    try:
        text = (directory / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _field(path: Path, key: str) -> int | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return next((int(v) for k, _, v in (ln.partition(" ") for ln in lines) if k == key), None)


def effective_budget(total_mb: float, available_mb: float, cgroup: CgroupMemory,
                     fraction: float, budget_mb: float | None, pool_used_mb: float) -> float:
    """What the pool may hold now: memory_fraction x the smaller of RAM and the cgroup's
    limit (or memory_budget_mb), and never more than it holds plus what is available
    (in the cgroup too) less the same (1 - fraction) margin: memory other processes
    take shrinks it, memory they give back lets it grow again."""
    ceiling = min(total_mb, cgroup.limit_mb or total_mb)
    configured = budget_mb or fraction * ceiling
    if cgroup.limit_mb is not None and cgroup.usage_mb is not None:
        available_mb = min(available_mb, cgroup.limit_mb - cgroup.usage_mb)
    room = pool_used_mb + available_mb - (1 - fraction) * ceiling
    return max(0.0, min(configured, room))


def plan_relief(view: scaling.PoolView, device: str = "cpu") -> scaling.Plan:
    """Under outside pressure (the pool holds more than its budget now allows), stop
    idle workers, least recently used first, until enough is freed, or all of them."""
    need = view.used_mb.get(device, 0.0) - view.budget_mb.get(device, 0.0)
    if need <= 0:
        return scaling.Plan()
    candidates = [memory.EvictionCandidate(worker_id, m.key, last_used, m.charge.per_worker_mb,
                                           m.charge.weights_mb, m.charge.workers,
                                           m.charge.shared_weights)
                  for m in view.models.values() if m.device == device
                  for worker_id, last_used in m.idle_workers]
    chosen = memory.pick_evictions(candidates, need) or [c.worker_id for c in candidates]
    by_id = {c.worker_id: c.model_key for c in candidates}
    return scaling.Plan(stop=tuple(scaling.Stop(w, by_id[w], "evicted") for w in chosen))


class OomCounter:
    """The cgroup's count of OOM kills, to tell a worker the kernel killed for memory."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self.seen = read_cgroup(directory).oom_kills or 0

    def new_kills(self) -> int:
        """OOM kills in the cgroup since the last call."""
        now = read_cgroup(self.directory).oom_kills or 0
        new, self.seen = max(0, now - self.seen), now
        return new


def exit_cause(exitcode: int | None, killed_by_us: bool, oom_kills: int) -> str:
    """Words for a worker's exit: a SIGKILL modelpool did not send is the OOM killer's
    when the cgroup counted one, and most likely its otherwise."""
    if exitcode != -signal.SIGKILL or killed_by_us:
        return exitcodes.describe(exitcode)
    if oom_kills:
        return (f"killed by the kernel's OOM killer (the cgroup's oom_kill count rose by "
                f"{oom_kills}): the machine ran out of memory")
    return ("killed by SIGKILL, which modelpool did not send: most likely the kernel's "
            "OOM killer (see `dmesg`)")
