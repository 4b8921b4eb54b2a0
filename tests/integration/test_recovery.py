"""Health and recovery with real processes: killed, stopped and failing workers."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, Daemon, MakeDaemon, model_entry, wait_until

from modelpool.protocol.client import AsyncClient, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor import shm


def worker_pids(daemon: Daemon, key: str) -> list[int]:
    with daemon.client() as c:
        model = next(m for m in c.status()["models"] if m["key"] == key)
    return [w["pid"] for w in model["workers"] if w["state"] in ("idle", "busy")]


async def _round(daemon: Daemon, clients: list[AsyncClient], rng: random.Random) -> None:
    texts = ["x" * rng.randint(1, 50) for _ in clients]
    calls = [asyncio.ensure_future(c.embed(t, model="slow"))
             for c, t in zip(clients, texts, strict=True)]
    await asyncio.sleep(0.05)
    pids = worker_pids(daemon, "slow")
    if pids:
        victim = rng.choice(pids)
        os.kill(victim, signal.SIGKILL)
        # Until the death is noticed the worker still looks idle and may be handed the
        # next round's work: a job dying on two killed workers is WORKER_DIED by design,
        # so keep this test to one death per job.
        while victim in worker_pids(daemon, "slow"):
            await asyncio.sleep(0.005)
    results = await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
    assert [float(r[0]) for r in results] == [float(len(t)) for t in texts]


def test_sigkill_mid_request_under_32_clients(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(model_entry("slow", run_s=0.05, max_workers=2))

    async def run() -> None:
        clients = [await AsyncClient(daemon.socket_path).connect() for _ in range(32)]
        try:
            rng = random.Random(7)
            for _ in range(10):
                await _round(daemon, clients, rng)
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())
    assert daemon.log().count("killed by SIGKILL") >= 5
    deadline = time.monotonic() + 10
    while len(worker_pids(daemon, "slow")) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with daemon.client() as c:  # a replacement is ready and serving
        assert c.embed("abc", model="slow")[0] == 3.0


def test_sigstopped_worker_is_detected_killed_and_its_work_requeued(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\nheartbeat_timeout_s = 1.0\ncold_start_workers = 1\n"
                         + model_entry("slow", run_s=0.3, max_workers=2))
    with daemon.client() as c:
        c.embed("warm", model="slow")
        time.sleep(1.5)  # longer than the timeout: a healthy idle worker keeps beating
        (worker,) = next(m for m in c.status()["models"] if m["key"] == "slow")["workers"]
    assert worker["last_heartbeat_s"] < 1.0 and "is hung" not in daemon.log()
    pid = worker["pid"]

    async def run() -> float:
        async with AsyncClient(daemon.socket_path) as c:
            call = asyncio.ensure_future(c.embed("abcd", model="slow"))
            await asyncio.sleep(0.1)  # the worker has taken the job
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            result = await asyncio.wait_for(call, timeout=30)
            assert result[0] == 4.0
            return time.monotonic() - stopped

    took = asyncio.run(run())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "is hung (no heartbeat" in daemon.log()
    assert took < 1.0 + 1.0 + 3.0  # detection within timeout + 1 s, then a respawn


def test_a_worker_silent_while_it_loads_is_raised_before_it_is_judged_hung(
        make_daemon: MakeDaemon) -> None:
    """It beats, then holds the GIL for 3 s in a C call while it loads: past the 2 s
    heartbeat timeout. Raised from idle priority then, it is judged a timeout later, by
    which time it has loaded and beats again."""
    daemon = make_daemon("[pool]\nheartbeat_timeout_s = 2.0\ncold_start_workers = 1\n"
                         + model_entry("quiet", load_s=1, silent_load_s=3, max_workers=1))
    with daemon.client() as c:
        assert c.embed("abc", model="quiet", timeout_s=60)[0] == 3.0
    log = daemon.log()
    assert "raising it to normal priority" in log and "last heartbeat" in log
    assert "is hung" not in log and "killed by" not in log


def test_failing_loader_backs_off_then_fails_and_load_resets_it(
        make_daemon: MakeDaemon) -> None:
    # a worker starved at idle priority before its first beat is raised after
    # heartbeat_timeout_s: well inside the first request's bound below
    daemon = make_daemon("[pool]\nload_backoff_s = 3\nmax_load_failures = 2\n"
                         "heartbeat_timeout_s = 2.0\n"
                         + model_entry("broken", loader="failing"))
    with daemon.client() as c:
        started = time.monotonic()
        with pytest.raises(PoolError) as first:
            c.embed("x", model="broken")
        assert time.monotonic() - started < 5  # failed at once, not after the back-off
        assert first.value.code is ErrorCode.MODEL_LOAD_FAILED and "boom" in first.value.message
        while worker_pids(daemon, "broken") or any(
                m["workers"] for m in c.status()["models"] if m["key"] == "broken"):
            time.sleep(0.02)  # both cold-start workers have failed and exited
        with pytest.raises(PoolError) as backing_off:  # within the back-off: at once
            c.embed("x", model="broken")
        assert "retrying in" in backing_off.value.message
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # after the back-off a request tries again
            with pytest.raises(PoolError) as second:
                c.embed("x", model="broken")
            if "retrying in" not in second.value.message:
                break
            time.sleep(0.2)
        assert "boom" in second.value.message  # the second attempt failed: now failed
        status = next(m for m in c.status()["models"] if m["key"] == "broken")
        assert status["state"] == "failed" and status["health"].startswith("failed")
        health = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "--socket",
                                 daemon.socket_path, "health"], capture_output=True, text=True,
                                cwd=ROOT, timeout=60)
        assert health.returncode == 1 and "broken" in health.stdout
        with pytest.raises(PoolError) as failed:
            c.embed("x", model="broken")
        assert "modelpool load broken" in failed.value.message
        c.load("broken")  # resets the failure count; the load is attempted again
        status = next(m for m in c.status()["models"] if m["key"] == "broken")
        assert status["state"] != "failed"


def _shm_entries(daemon: Daemon) -> set[str]:
    """/dev/shm but for what concurrent tests' processes make there: other daemons'
    segments and PostgreSQL servers' (cluster)."""
    ours = shm.segment_prefix(daemon.process.pid)
    return {n for n in os.listdir("/dev/shm") if n.startswith(ours)
            or not n.startswith((shm.PREFIX, "PostgreSQL."))}


def test_no_leak_after_200_worker_kills(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n"
                         + model_entry("slow", run_s=0, max_workers=2))
    with daemon.client() as c:
        c.load("slow", workers=1)
        c.embed("x", model="slow")
    supervisor = psutil.Process(daemon.process.pid)
    fds_before, shm_before = supervisor.num_fds(), _shm_entries(daemon)
    kills = 0
    deadline = time.monotonic() + 120
    while kills < 200 and time.monotonic() < deadline:
        pids = worker_pids(daemon, "slow")
        if not pids:
            time.sleep(0.01)
            continue
        os.kill(pids[0], signal.SIGKILL)
        kills += 1
        while pids[0] in worker_pids(daemon, "slow"):
            time.sleep(0.005)
    assert kills == 200
    with daemon.client() as c:
        assert c.embed("abc", model="slow")[0] == 3.0
    assert supervisor.num_fds() <= fds_before + 2  # the status client's own socket, at most
    assert _shm_entries(daemon) <= shm_before
    health = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "--socket",
                             daemon.socket_path, "health"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert health.returncode == 0, health.stdout


def _holder_and_sibling(daemon: Daemon, key: str) -> tuple[int, int] | None:
    """The pids of the model's worker running a job and of its idle sibling."""
    with daemon.client() as c:
        model = next(m for m in c.status()["models"] if m["key"] == key)
    busy = [w["pid"] for w in model["workers"] if w["inflight"]]
    idle = [w["pid"] for w in model["workers"] if not w["inflight"]]
    return (busy[0], idle[0]) if busy and idle else None


def test_stopped_workers_are_killed_at_their_timeout_and_the_retry_skips_a_silent_one(
        make_daemon: MakeDaemon) -> None:
    # Beats every 0.1 s: the holder is killed 1.9 to 2.25 s after it stopped, always
    # before its sibling, stopped 0.6 s after it, is hung (2.5 s or later).
    daemon = make_daemon("[pool]\nheartbeat_timeout_s = 2.0\nheartbeat_interval_s = 0.1\n"
                         "cold_start_workers = 2\n"
                         + model_entry("slow", run_s=1.0, max_workers=2))
    with daemon.client() as c:
        c.embed("warm", model="slow")
    wait_until(lambda: len(worker_pids(daemon, "slow")) == 2, 30, "two workers ready")

    async def run() -> float:
        async with AsyncClient(daemon.socket_path) as c:
            call = asyncio.ensure_future(c.embed("abcd", model="slow"))
            holder, sibling = await asyncio.to_thread(
                wait_until, lambda: _holder_and_sibling(daemon, "slow"), 10,
                "the job running on one of the two workers")
            os.kill(holder, signal.SIGSTOP)
            stopped = time.monotonic()
            # Not hung yet when the holder is killed, but late (silent over 0.4 s, four
            # beats): the holder's job, retried, is not handed to it to die with it.
            await asyncio.sleep(0.6)
            os.kill(sibling, signal.SIGSTOP)
            result = await asyncio.wait_for(call, timeout=30)
            assert result[0] == 4.0
            return time.monotonic() - stopped

    took = asyncio.run(run())
    log = daemon.log()
    assert log.count("is hung (no heartbeat") == 2, log
    assert "no new work until it beats again" in log
    # 2 s of silence, a check every 0.25 s, SIGKILL at once (a SIGTERM, which a stopped
    # process would not act on, would wait out a grace of 6 s), then a replacement loads
    # (no weights) and runs it for 1 s.
    assert took < 8.0, took


def test_stop_with_a_hung_worker_takes_the_drain_and_no_more(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\nheartbeat_timeout_s = 60\nshutdown_timeout_s = 2\n"
                         "cold_start_workers = 1\n" + model_entry("slow", run_s=0.5))
    with daemon.client() as c:
        c.embed("warm", model="slow")
    (pid,) = worker_pids(daemon, "slow")

    async def run() -> float:
        async with AsyncClient(daemon.socket_path) as c:
            call = asyncio.ensure_future(c.embed("abcd", model="slow"))
            await asyncio.sleep(0.1)  # the worker has taken the job
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGTERM)
            with pytest.raises(PoolError) as err:
                await asyncio.wait_for(call, timeout=30)
            assert err.value.code is ErrorCode.SHUTTING_DOWN
            await asyncio.get_running_loop().run_in_executor(None, daemon.process.wait, 30)
            return time.monotonic() - started

    took = asyncio.run(run())
    assert daemon.process.returncode == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert took < 2.0 + 1.5, took  # shutdown_timeout_s, then kill what is left at once
