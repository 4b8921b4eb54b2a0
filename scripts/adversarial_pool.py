#!/usr/bin/env python
"""What one client or one worker can do to the others, against a real daemon with fake
models (tests/integration/mp_test_loaders.py): the split of dispatches between a flooding
and a polite client at equal priority, a SIGSTOPped busy worker until its request is
answered, and a stop with one hung (SIGSTOPped) worker until the daemon has exited.

Prints one JSON object, each figure beside its target:

    python scripts/adversarial_pool.py                 # ~2 minutes on 2 cores
    python scripts/adversarial_pool.py --seconds 4 --trials 1

A flood from another user (uid 101, as in tests/adversarial/) needs root; without it
those cases are skipped, saying why. The fairness cases are in
scripts/adversarial_fairness.py; scripts/adversarial.py includes these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

import psutil
from adversarial_daemon import integration, model_status, serving
from adversarial_fairness import fairness_figures

HEARTBEAT_TIMEOUT_S = 2.0
SHUTDOWN_TIMEOUT_S = 2.0


# ---- a SIGSTOPped busy worker ------------------------------------------------------------

def hung_config() -> str:
    entry = integration().model_entry
    return (f"[pool]\nheartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}\ncold_start_workers = 1\n"
            + entry("slow", run_s=0.2, max_workers=2)
            + entry("gen", loader="counting_generator", capability="text_to_text",
                    step_s=0.02, max_workers=1))


def ready_pids(daemon: Any, key: str, count: int, timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    with daemon.client() as c:
        while time.monotonic() < deadline:
            workers = model_status(c.status(), key)["workers"]
            if sum(w["state"] == "idle" for w in workers) >= count:
                return [w["pid"] for w in workers if w["state"] in ("idle", "busy")]
            time.sleep(0.05)
    raise RuntimeError(f"{key} never had {count} idle workers")


async def stopped_embed(daemon: Any) -> float:
    """One of two idle workers takes a request and is SIGSTOPped: the request is answered
    (re-queued once, run again by the other worker, 0.2 s) this long after the stop."""
    from modelpool.protocol.async_client import AsyncClient

    async with AsyncClient(daemon.socket_path) as c:
        call = asyncio.ensure_future(c.embed(f"stop me {time.monotonic()}", model="slow"))
        busy: list[int] = []
        while not busy:
            busy = [w["pid"] for w in model_status(await c.status(), "slow")["workers"]
                    if w["state"] == "busy"]
            await asyncio.sleep(0 if busy else 0.005)
        os.kill(busy[0], signal.SIGSTOP)
        stopped = time.monotonic()
        await asyncio.wait_for(call, timeout=60)
        return time.monotonic() - stopped


async def stopped_stream(daemon: Any, pid: int) -> tuple[float, str, float]:
    """A stream that has sent tokens cannot be run again: its worker is SIGSTOPped and
    the stream ends WORKER_DIED this long after the stop (detection and kill alone)."""
    from modelpool.protocol.async_client import AsyncClient
    from modelpool.protocol.client import PoolError

    async with AsyncClient(daemon.socket_path) as c:
        stopped = None
        try:
            async for _ in c.generate("go", model="gen", max_tokens=100_000):
                if stopped is None:
                    os.kill(pid, signal.SIGSTOP)
                    stopped, wall = time.monotonic(), time.time()
        except PoolError as exc:
            assert stopped is not None
            return time.monotonic() - stopped, exc.code.value, wall
    raise RuntimeError("the stream ended without an error")


def sigstop_figures(trials: int) -> dict[str, Any]:
    embeds: list[float] = []
    streams: list[float] = []
    codes: Counter[str] = Counter()
    walls: list[float] = []
    with serving(hung_config()) as daemon:
        with daemon.client() as c:
            c.load("slow", workers=2)  # a minimum of two, restored after each kill
            c.load("gen", workers=1)
        for _ in range(trials):  # each with every replacement ready: no start beside it
            ready_pids(daemon, "gen", 1)
            ready_pids(daemon, "slow", 2)
            embeds.append(asyncio.run(stopped_embed(daemon)))
            ready_pids(daemon, "slow", 2)
            (pid,) = ready_pids(daemon, "gen", 1)
            took, code, wall = asyncio.run(stopped_stream(daemon, pid))
            streams.append(took)
            codes[code] += 1
            walls.append(wall)
        log = daemon.log()
    phases = [log_phases(log, wall, HANG_PHASES) for wall in walls]
    target = HEARTBEAT_TIMEOUT_S + 0.5
    return {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "target_s": target,
            "embed_answered_by_the_other_worker_s": [round(t, 3) for t in embeds],
            "stream_answered_worker_died_s": [round(t, 3) for t in streams],
            "stream_codes": dict(codes), "stream_log_s": phases,
            "max_s": round(max(embeds + streams), 3),
            "within_target": max(embeds + streams) <= target}


# ---- stop with a hung worker --------------------------------------------------------------

def stop_config() -> str:
    return (f"[pool]\nheartbeat_timeout_s = 60\nshutdown_timeout_s = {SHUTDOWN_TIMEOUT_S}\n"
            "cold_start_workers = 1\n" + integration().model_entry("slow", run_s=0.5,
                                                                   max_workers=1))


async def stop_with_hung_worker(daemon: Any, how: str, busy: bool) -> dict[str, Any]:
    """SIGSTOP the model's worker (busy with a request, or idle), then SIGTERM the daemon
    or send it `stop`: how long until the daemon has exited, and what the request got."""
    from modelpool.protocol.async_client import AsyncClient
    from modelpool.protocol.client import PoolError

    (pid,) = ready_pids(daemon, "slow", 1)
    async with AsyncClient(daemon.socket_path) as c:
        call = asyncio.ensure_future(c.embed("hung", model="slow")) if busy else None
        await asyncio.sleep(0.1)  # the worker has taken it
        os.kill(pid, signal.SIGSTOP)
        started, wall = time.monotonic(), time.time()
        if how == "sigterm":
            daemon.process.send_signal(signal.SIGTERM)
        else:
            async with AsyncClient(daemon.socket_path) as admin:
                await admin.stop()  # what `modelpool stop` sends
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(None, daemon.process.wait, 60)
        took = time.monotonic() - started
        left = gone_or_kill(pid)
        reply = "none sent"
        if call is not None:
            try:
                await asyncio.wait_for(call, 5)
                reply = "served"
            except PoolError as exc:
                reply = exc.code.value
    return {"how": how, "worker_busy": busy, "exited_after_s": round(took, 3),
            "exit_code": code, "request_got": reply, "hung_worker_left_behind": left,
            "log_s": log_phases(daemon.log(), wall, STOP_PHASES)}


STOP_PHASES = {"stopping": "stopping: refusing new work", "killed": "did not exit; killing",
               "stopped": "modelpool.shutdown: stopped in"}
HANG_PHASES = {"hung": "of gen is hung", "exit_seen": "of gen exited"}


def log_phases(log: str, since: float, phases: dict[str, str]) -> dict[str, float]:
    """When the daemon first logged each phase at or after `since`, in seconds after it."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        for phase, text in phases.items():
            if text in line and phase not in found:
                stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                if stamp.timestamp() >= since - 0.002:
                    found[phase] = round(stamp.timestamp() - since, 3)
    return found


def gone_or_kill(pid: int) -> bool:
    """Whether the worker outlived its daemon (then it is killed here)."""
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def shutdown_figures(trials: int) -> dict[str, Any]:
    runs = []
    for how in ("sigterm", "stop"):
        for busy in (True, False):
            for _ in range(trials):
                with serving(stop_config()) as daemon:
                    with daemon.client() as c:
                        c.embed("warm", model="slow")
                    runs.append(asyncio.run(stop_with_hung_worker(daemon, how, busy)))
    target = SHUTDOWN_TIMEOUT_S + 1.0
    worst = max(r["exited_after_s"] for r in runs)
    return {"shutdown_timeout_s": SHUTDOWN_TIMEOUT_S, "target_s": target, "runs": runs,
            "max_s": worst, "within_target": worst <= target}


def pool_figures(seconds: float, trials: int) -> dict[str, Any]:
    return {"fairness": fairness_figures(seconds), "sigstop": sigstop_figures(trials),
            "stop_with_hung_worker": shutdown_figures(trials)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="each fairness window")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(pool_figures(args.seconds, args.trials), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
