"""Memory that follows the machine: the cgroup's limit and usage (v1 and v2 files, made
up in a temporary directory), the budget under outside pressure, idle workers evicted
first, and a worker the OOM killer took, named as such."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from modelpool.protocol.errors import ErrorCode
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import memory, pressure

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]
MIB = 2**20

V1_CGROUP = "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n0::/\n"
V1_MOUNTS = ("30 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
             "31 25 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n")
V2_CGROUP = "0::/system.slice/modelpool.service\n"
V2_MOUNTS = "40 30 0:35 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"


def test_the_memory_cgroup_is_found_in_v1_and_v2() -> None:
    assert pressure.memory_cgroup_dir(V1_CGROUP, V1_MOUNTS) == Path(
        "/sys/fs/cgroup/memory/docker/abc")
    assert pressure.memory_cgroup_dir(V2_CGROUP, V2_MOUNTS) == Path(
        "/sys/fs/cgroup/system.slice/modelpool.service")
    assert pressure.memory_cgroup_dir("", "") is None


def test_v2_files(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(f"{4096 * MIB}\n")
    (tmp_path / "memory.current").write_text(f"{1024 * MIB}\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert pressure.read_cgroup(tmp_path) == pressure.CgroupMemory(4096.0, 1024.0, 2)
    (tmp_path / "memory.max").write_text("max\n")
    assert pressure.read_cgroup(tmp_path).limit_mb is None


def test_v1_files_with_no_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory.usage_in_bytes").write_text(f"{512 * MIB}\n")
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert pressure.read_cgroup(tmp_path) == pressure.CgroupMemory(None, 512.0, 5)
    assert pressure.read_cgroup(None) == pressure.CgroupMemory(None, None, None)


NO_CGROUP = pressure.CgroupMemory(None, None, None)


def test_the_budget_is_a_fraction_of_the_smaller_of_ram_and_the_cgroup_limit() -> None:
    assert pressure.effective_budget(10000, 10000, NO_CGROUP, 0.8, None, 0) == 8000
    limited = pressure.CgroupMemory(2000, 0, None)
    assert pressure.effective_budget(10000, 10000, limited, 0.8, None, 0) == 1600
    assert pressure.effective_budget(10000, 10000, NO_CGROUP, 0.8, 3000, 0) == 3000
    # What the machine itself uses counts too: 1 GB taken leaves 9000 - 2000 margin.
    assert pressure.effective_budget(10000, 9000, NO_CGROUP, 0.8, None, 0) == 7000


def test_outside_pressure_shrinks_the_budget_and_its_end_restores_it() -> None:
    # Others took 7 GB of 10: the pool (1 GB held) may grow by what is left less the
    # 20 % margin: 1000 + 2000 - 2000.
    assert pressure.effective_budget(10000, 2000, NO_CGROUP, 0.8, None,
                                     1000) == pytest.approx(1000)
    assert pressure.effective_budget(10000, 500, NO_CGROUP, 0.8, None, 1000) == 0
    assert pressure.effective_budget(10000, 9000, NO_CGROUP, 0.8, None, 1000) == 8000
    # In a cgroup, what is available is also bounded by its limit less its usage.
    crowded = pressure.CgroupMemory(4000, 3500, None)
    assert pressure.effective_budget(10000, 9000, crowded, 0.8, None, 1000) == pytest.approx(700)


async def test_idle_workers_are_evicted_least_recently_used_first_under_pressure(
        make_harness: MakeHarness) -> None:
    specs = [ModelSpec(key=k, capability="text_embedding", path="/x", weights_mb=100,
                       per_worker_mb=100) for k in ("a", "b")]
    h = make_harness(models=specs, cold_start_workers=1)
    for key in ("a", "b"):
        h.embed(h.sink(), ["x"], model=key)
        await h.settle()
        (worker,) = h.workers(key)
        h.ready(worker)
        h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
        h.want_work(worker)
        h.clock.advance(1)
    view = h.pool.capacity.view(h.pool.models.values())
    assert pressure.plan_relief(view).stop == ()  # within budget: nothing
    facts = memory.MemoryFacts(total_mb=10000, available_mb=1850)  # others took the rest
    h.pool.capacity.follow_machine(facts, NO_CGROUP, h.used_mb())
    assert h.pool.capacity.budget_mb == pytest.approx(400 + 1850 - 2000)
    plan = pressure.plan_relief(h.pool.capacity.view(h.pool.models.values()))
    assert [(s.model_key, s.reason) for s in plan.stop] == [("a", "evicted")]  # a: older
    h.pool.apply(plan)
    assert h.launcher.stopped == h.workers("a")


async def test_a_worker_killed_by_the_oom_killer_is_reported_as_such(
        make_harness: MakeHarness, tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("oom 0\noom_kill 0\n")
    h = make_harness()
    h.pool.oom = pressure.OomCounter(tmp_path)
    sink = h.sink()
    client_id = h.generate(sink)
    await h.settle()
    worker, _ = h.workers("gen")
    h.ready(worker)
    ((job_id, _),) = h.items(h.works(worker)[0])
    h.chunk(worker, job_id, 0, "a")
    events.write_text("oom 1\noom_kill 1\n")  # the kernel took it
    h.die(worker, -9)
    error = sink.only_error(client_id)
    assert error.code is ErrorCode.WORKER_DIED
    assert "killed by the kernel's OOM killer" in error.message


def test_exit_causes() -> None:
    assert "OOM killer (the cgroup's oom_kill count rose by 1)" in pressure.exit_cause(
        -9, False, 1)
    assert "most likely the kernel's OOM killer" in pressure.exit_cause(-9, False, 0)
    assert pressure.exit_cause(-9, True, 0) == "killed by SIGKILL"  # modelpool's own kill
    assert pressure.exit_cause(-11, False, 1) == "killed by SIGSEGV"
