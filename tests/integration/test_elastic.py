"""The elastic pool with real processes: cold start, growth, shrink, memory, isolation."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import Daemon, MakeDaemon, model_entry, wait_until

from modelpool.protocol.client import AsyncClient, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor.cgroups import loading_cgroup_dir, own_cpu_cgroup_dir
from modelpool.workers import priority

SERVING_CGROUP = own_cpu_cgroup_dir()
IDLE_CGROUP_POSSIBLE = SERVING_CGROUP is not None and os.access(SERVING_CGROUP, os.W_OK)
LOWERED = priority.can_restore(os.getpriority(os.PRIO_PROCESS, 0))  # else nothing is


def start_loading(daemon: Daemon, key: str) -> int:
    """The pid of one worker of `key`, once it is loading."""
    with daemon.client() as c:
        c.load(key, workers=1)
    wait_until(lambda: [w["state"] for w in status_of(daemon, key)["workers"]]
               == ["loading"], 10, "a worker loading")
    return status_of(daemon, key)["workers"][0]["pid"]


def cpu_cgroup(pid: int, tid: int | None = None) -> str:
    """A process's (or one thread's) cgroup in the cgroup v1 cpu hierarchy."""
    lines = Path(f"/proc/{pid}/task/{tid or pid}/cgroup").read_text().splitlines()
    return next(path for _, controllers, path in (line.split(":", 2) for line in lines)
                if "cpu" in controllers.split(","))


def status_of(daemon: Daemon, key: str) -> dict[str, Any]:
    with daemon.client() as c:
        return next(m for m in c.status()["models"] if m["key"] == key)


def test_cold_start_two_then_grow_under_load_then_shrink_to_zero(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncooldown_idle_s = 1.0\nmax_workers_per_model = 3\n"
                         + model_entry("m", run_s=0.3) + "max_batch = 1\n")
    assert status_of(daemon, "m")["workers"] == []  # nothing before the first request
    with daemon.client() as c:
        c.embed("first", model="m")
    assert len(status_of(daemon, "m")["workers"]) == 2  # 0 -> 2 on the first request

    async def burst() -> None:
        async with AsyncClient(daemon.socket_path) as c:
            await asyncio.gather(*(c.embed(f"t{i}", model="m") for i in range(24)))

    asyncio.run(burst())
    assert len(status_of(daemon, "m")["workers"]) == 3  # +1 while all were busy
    wait_until(lambda: status_of(daemon, "m")["workers"] == [], 15, "scale down to 0")
    assert status_of(daemon, "m")["memory_mb"] == 0


def test_idle_model_is_evicted_for_one_that_needs_the_room(make_daemon: MakeDaemon) -> None:
    big = 'weights_mb = 300\nper_worker_mb = 100\n'
    daemon = make_daemon("[pool]\nmemory_budget_mb = 500\ncold_start_workers = 1\n"
                         + model_entry("a") + big + model_entry("b") + big)
    with daemon.client() as c:
        c.embed("x", model="a")
        assert len(status_of(daemon, "a")["workers"]) == 1
        c.embed("y", model="b")  # a (idle) must go to make room
        assert status_of(daemon, "a")["workers"] == []
        assert len(status_of(daemon, "b")["workers"]) == 1
    assert "stopping worker 1 of a: idle, to make room for another model" in daemon.log()


def test_a_model_that_can_never_fit_is_refused_at_once(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\nmemory_budget_mb = 500\n" + model_entry("huge")
                         + "weights_mb = 4000\n")
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed("x", model="huge")
    assert err.value.code is ErrorCode.INSUFFICIENT_MEMORY
    assert "huge" in err.value.message and "500" in err.value.message


def test_a_loading_model_never_delays_a_loaded_one(make_daemon: MakeDaemon) -> None:
    # One worker each, so the two loads fit the two load slots (max_concurrent_loads).
    daemon = make_daemon("[pool]\ncold_start_workers = 1\nidle_load_s = 60\n"
                         + model_entry("fast") + model_entry("slow-a", load_s=4)
                         + model_entry("slow-b", load_s=4))
    with daemon.client() as c:
        c.embed("warm", model="fast")
    done: list[float] = []

    def load(key: str) -> None:
        with daemon.client() as c:
            c.embed("x", model=key)
            done.append(time.monotonic())

    started = time.monotonic()
    loaders = [threading.Thread(target=load, args=(k,)) for k in ("slow-a", "slow-b")]
    for thread in loaders:
        thread.start()
    latencies = []
    with daemon.client() as c:
        while time.monotonic() - started < 3:
            t0 = time.monotonic()
            c.embed("ping", model="fast")
            latencies.append(time.monotonic() - t0)
    (fast,), (slow,) = ([w["pid"] for w in status_of(daemon, key)["workers"]]
                        for key in ("fast", "slow-a"))
    policies = os.sched_getscheduler(fast), os.sched_getscheduler(slow)
    groups = (cpu_cgroup(fast), cpu_cgroup(slow)) if IDLE_CGROUP_POSSIBLE else None
    for thread in loaders:
        thread.join(30)
    assert max(latencies) < 0.5, max(latencies)  # generous: ~1 ms is typical
    assert len(done) == 2 and max(done) - started < 8  # the two loads ran side by side
    if not LOWERED:
        return
    if groups is None:
        assert policies == (os.SCHED_BATCH, os.SCHED_IDLE)
    else:  # loading in the idle cgroup instead of SCHED_IDLE
        assert policies == (os.SCHED_BATCH, os.SCHED_OTHER)
        assert not groups[0].endswith("-loading")
        assert groups[1].endswith(f"/modelpool-{daemon.process.pid}-loading")


@pytest.mark.skipif(not (IDLE_CGROUP_POSSIBLE and LOWERED), reason="no writable cgroup v1 cpu "
                    "hierarchy, or no right to restore priority")
def test_the_idle_cgroup_holds_the_forkserver_not_serving_workers_and_goes_with_the_daemon(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n" + model_entry("fast"))
    assert SERVING_CGROUP is not None
    loading = loading_cgroup_dir(SERVING_CGROUP, daemon.process.pid)
    assert (loading / "cpu.idle").read_text().strip() == "1"
    with daemon.client() as c:
        c.embed("warm", model="fast")
    (worker,) = [w["pid"] for w in status_of(daemon, "fast")["workers"]]
    members = {int(pid) for pid in (loading / "cgroup.procs").read_text().split()}
    others = {p.pid for p in daemon.descendants()} - {worker}
    assert members and members <= others  # the forkserver (and what it has not forked yet)
    assert {cpu_cgroup(worker, t.id) for t in psutil.Process(worker).threads()} == {
        cpu_cgroup(daemon.process.pid)}
    daemon.stop()
    assert not loading.exists()


def test_without_the_idle_cgroup_a_loading_worker_runs_sched_idle(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[daemon]\nidle_cgroup = false\n[pool]\ncold_start_workers = 1\n"
                         "idle_load_s = 60\n" + model_entry("slow", load_s=3))
    slow = start_loading(daemon, "slow")
    policy = os.sched_getscheduler(slow)
    if LOWERED:
        assert policy == os.SCHED_IDLE
    if IDLE_CGROUP_POSSIBLE:
        assert not cpu_cgroup(slow).endswith("-loading")
        assert SERVING_CGROUP is not None
        assert not loading_cgroup_dir(SERVING_CGROUP, daemon.process.pid).exists()


@pytest.mark.skipif(not LOWERED, reason="no right to restore priority: loads are not lowered")
@pytest.mark.parametrize("idle_cgroup", ["true", "false"])
def test_a_new_worker_at_idle_priority_on_busy_cores_is_never_killed_as_hung(
        make_daemon: MakeDaemon, idle_cgroup: str) -> None:
    """Every core kept busy by normal work: a worker forked at idle priority may get too
    little CPU to start the heartbeat thread that would raise it. Then the supervisor
    raises it a heartbeat timeout after its start; either way it loads and serves, and
    is never killed as hung. (Whether it starves is up to the kernel: an idle cgroup
    still gets a sliver, and on some runs that is enough to beat within the timeout.)"""
    daemon = make_daemon(f"[daemon]\nidle_cgroup = {idle_cgroup}\n[pool]\n"
                         "cold_start_workers = 1\nheartbeat_timeout_s = 2\n"
                         + model_entry("fresh", run_s=0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        with daemon.client(timeout_s=60) as c:
            assert c.embed(["served"], model="fresh")[0][0] == len("served")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    log = daemon.log()
    assert "is hung" not in log, log
    assert "killing it" not in log, log


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) echo "0, 16000, Fake GPU" ;;
  *) exec sleep 8 ;;  # the per-process memory query hangs, as on a wedged GPU
esac
"""


def test_a_hanging_nvidia_smi_never_holds_up_scale_down(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    daemon = make_daemon(
        "[pool]\ncooldown_idle_s = 1\n" + model_entry("cpu-model", run_s=0)
        + '        device = "cpu"\n',
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert "Fake GPU" in daemon.log()  # the daemon found the fake GPU, so it measures VRAM
    with daemon.client() as c:
        c.embed("warm", model="cpu-model")
    idle_since = time.monotonic()
    wait_until(lambda: not status_of(daemon, "cpu-model")["workers"], 6,
               "both workers stopped one cooldown apart")
    assert time.monotonic() - idle_since < 6


def test_realtime_puts_only_the_event_loop_in_sched_fifo(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[daemon]\nrealtime = true\n[pool]\ncold_start_workers = 1\n"
                         + model_entry("fast"))
    with daemon.client() as c:
        c.embed("warm", model="fast")
    supervisor = psutil.Process(daemon.process.pid)
    loop_policy = os.sched_getscheduler(supervisor.pid)  # the main thread runs the loop
    if "may not use SCHED_FIFO" in daemon.log():
        assert loop_policy == os.SCHED_OTHER
        pytest.skip("SCHED_FIFO is not permitted on this machine")
    assert loop_policy == os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    threads = [os.sched_getscheduler(t.id) for t in supervisor.threads() if t.id != supervisor.pid]
    assert threads and set(threads) == {os.SCHED_OTHER}  # the executor's, at least
    processes = {os.sched_getscheduler(p.pid) & ~os.SCHED_RESET_ON_FORK
                 for p in daemon.descendants()}
    assert processes and not processes & {os.SCHED_FIFO, os.SCHED_RR}


def test_unloading_a_model_while_it_loads_is_not_a_load_failure(
        make_daemon: MakeDaemon) -> None:
    # A loading worker reads no Shutdown: it is killed once the stop grace (0.2 + 1 s)
    # is over, well before its 3 s load ends.
    daemon = make_daemon("[pool]\ncold_start_workers = 1\nshutdown_timeout_s = 0.2\n"
                         + model_entry("slow", load_s=3))
    start_loading(daemon, "slow")
    with daemon.client() as c:
        c.unload("slow")
        wait_until(lambda: not status_of(daemon, "slow")["workers"], 10, "the worker killed")
        assert status_of(daemon, "slow")["last_error"] is None
        assert len(c.embed(["loads again at once"], model="slow")) == 1


@pytest.mark.skipif(not LOWERED, reason="no right to restore priority: loads are not lowered")
def test_a_load_longer_than_idle_load_s_leaves_idle_priority(make_daemon: MakeDaemon) -> None:
    """So that a load still finishes on a machine that serving keeps busy, where an idle
    task gets almost no CPU."""
    daemon = make_daemon("[pool]\ncold_start_workers = 1\nidle_load_s = 0.5\n"
                         + model_entry("slow", load_s=6))
    slow = start_loading(daemon, "slow")
    time.sleep(1.5)  # past idle_load_s, still loading
    assert status_of(daemon, "slow")["workers"][0]["state"] == "loading"
    assert os.sched_getscheduler(slow) not in (os.SCHED_IDLE,)
    if IDLE_CGROUP_POSSIBLE:
        assert not cpu_cgroup(slow).endswith("-loading")
