"""Finding the cgroup v1 cpu hierarchy, and clearing loading cgroups of dead daemons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelpool.supervisor.cgroups import (
    cpu_cgroup_dir,
    loading_cgroup_dir,
    make_loading_cgroup,
    remove_stale,
)

MOUNTS_V1 = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_the_cpu_hierarchy_of_a_service() -> None:
    self_cgroup = ("5:cpuset:/\n4:cpu,cpuacct:/system.slice/modelpool.service\n"
                   "0::/system.slice/modelpool.service\n")
    assert cpu_cgroup_dir(self_cgroup, MOUNTS_V1) == Path(
        "/sys/fs/cgroup/cpu,cpuacct/system.slice/modelpool.service")


def test_the_root_cgroup_is_the_mount_point() -> None:
    assert cpu_cgroup_dir("4:cpu,cpuacct:/\n", MOUNTS_V1) == Path("/sys/fs/cgroup/cpu,cpuacct")


def test_a_container_sees_its_own_cgroup_at_the_mount_point() -> None:
    mounts = ("50 40 0:29 /docker/abc /sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup "
              "rw,cpu\n")
    assert cpu_cgroup_dir("3:cpu:/docker/abc\n", mounts) == Path("/sys/fs/cgroup/cpu")
    assert cpu_cgroup_dir("3:cpu:/docker/abc/inner\n", mounts) == Path(
        "/sys/fs/cgroup/cpu/inner")


def test_there_is_none_under_cgroup_v2_alone() -> None:
    mounts = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert cpu_cgroup_dir("0::/user.slice/user-1000.slice/session-2.scope\n", mounts) is None


def test_a_cpuset_hierarchy_is_not_the_cpu_one() -> None:
    mounts = "34 31 0:31 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n"
    assert cpu_cgroup_dir("5:cpuset:/\n", mounts) is None


def test_only_loading_cgroups_of_dead_daemons_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for name in (f"modelpool-{dead}-loading", f"modelpool-{os.getpid()}-loading",
                 "modelpool-x-loading", "someone-else"):
        (tmp_path / name).mkdir()
    remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"modelpool-{os.getpid()}-loading", "modelpool-x-loading", "someone-else"]


def writable_hierarchy_without_cpu_idle() -> Path | None:
    """A real cgroup v1 hierarchy this process may make cgroups in that has no cpu.idle
    (no cpu controller), as a kernel before 5.15 has none anywhere."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        root = Path(fields[4])
        if (fstype == "cgroup" and "cpu" not in options and fields[3] == "/"
                and os.access(root, os.W_OK) and not (root / "cpu.idle").exists()):
            return root
    return None


NO_CPU_IDLE = writable_hierarchy_without_cpu_idle()


@pytest.mark.skipif(NO_CPU_IDLE is None, reason="no writable cgroup v1 hierarchy without cpu")
def test_a_cgroup_that_cannot_be_marked_idle_is_not_left_behind() -> None:
    assert NO_CPU_IDLE is not None
    loading = loading_cgroup_dir(NO_CPU_IDLE, os.getpid())
    try:
        with pytest.raises(OSError):
            make_loading_cgroup(NO_CPU_IDLE)
        assert not loading.exists()
    finally:
        if loading.exists():
            loading.rmdir()
