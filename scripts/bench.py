#!/usr/bin/env python
"""Benchmarks of modelpool against an in-process baseline measured in the same run.

Prints one JSON object. Nothing here asserts: the figures are for people (and for the
issue tracker), the tests assert behaviour.

    python scripts/bench.py            # full run, ~2 minutes on 2 cores
    python scripts/bench.py --quick    # fewer samples
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from modelpool.protocol.client import AsyncClient, Client  # noqa: E402

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
WORDS = [
    "model", "pool", "worker", "request", "socket", "memory", "queue", "batch", "token",
    "stream", "image", "text", "vector", "daemon", "latency", "throughput", "supervisor",
    "process", "weights", "cache", "tensor",
]


def corpus(n: int, seed: int = 0) -> list[str]:
    """Sentences of 8 to 40 words: the spread of a typical retrieval workload."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "n": len(samples_s)}


# ---- in-process baseline --------------------------------------------------------------


def baseline(texts: list[str], singles: int, threads: int) -> dict[str, Any]:
    """The same model in this process, on `threads` torch threads."""
    import msgspec
    import torch

    from modelpool.registry.loaders import load_model
    from modelpool.registry.spec import Registry, load_catalog

    torch.set_num_threads(threads)
    spec = Registry(load_catalog()).resolve(MINILM)
    # Eager PyTorch: the baseline (the daemon runs the ONNX export, see bench_targets).
    model = load_model(msgspec.structs.replace(spec, execution="eager"))  # type: ignore[arg-type]
    for _ in range(5):
        model.embed(texts[:1])
    lat = []
    for text in texts[:singles]:
        t0 = time.perf_counter()
        model.embed([text])
        lat.append(time.perf_counter() - t0)
    by_batch = {}
    for batch in (1, 8, 16, 32, 64):
        t0 = time.perf_counter()
        done = 0
        while done < len(texts):
            model.embed(texts[done : done + batch])
            done += batch
        by_batch[batch] = round(len(texts) / (time.perf_counter() - t0), 1)
    best = max(by_batch, key=by_batch.__getitem__)
    return {"threads": threads, "single": percentiles(lat),
            "texts_per_s_by_batch": by_batch, "best_batch": best,
            "best_texts_per_s": by_batch[best]}


# ---- the daemon -----------------------------------------------------------------------


class Daemon:
    def __init__(self, config: str, prefix: list[str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mpbench-"))
        self.socket = str(self.dir / "mp.sock")
        (self.dir / "config.toml").write_text(config)
        env = dict(os.environ, HF_HUB_OFFLINE="1", MODELPOOL_SOCKET=self.socket,
                   PYTHONPATH=str(ROOT / "scripts"))
        env.update(json.loads(os.environ.get("BENCH_DAEMON_ENV", "{}")))
        self.started = time.perf_counter()
        with open(self.dir / "log", "wb") as log:
            self.process = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "modelpool.supervisor.cli", "serve",
                 "--config", str(self.dir / "config.toml")],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)

    def wait_listening(self) -> None:
        while True:
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(self.socket)
                    return
                except OSError:
                    time.sleep(0.01)

    def pss_mb(self) -> dict[str, float]:
        root = psutil.Process(self.process.pid)
        figures = {}
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):  # a worker may just have gone
                figures[f"{p.pid}:{' '.join(p.cmdline()[1:3])[:40]}"] = round(
                    p.memory_full_info().pss / 2**20, 1)
        return figures

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        if self.process.wait(30) == 0:  # else its log stays, to see why
            shutil.rmtree(self.dir, ignore_errors=True)


async def latency_through(sock: str, texts: list[str]) -> dict[str, float]:
    async with AsyncClient(sock) as c:
        for text in texts[:10]:
            await c.embed(text)
        lat = []
        for text in texts:
            t0 = time.perf_counter()
            await c.embed(text)
            lat.append(time.perf_counter() - t0)
    return percentiles(lat)


async def throughput_through(sock: str, texts: list[str], in_flight: int) -> float:
    async with AsyncClient(sock) as c:
        await asyncio.gather(*(c.embed(t) for t in texts[:in_flight]))  # warm both workers
        queue = list(texts)
        t0 = time.perf_counter()

        async def lane() -> None:
            while queue:
                await c.embed(queue.pop())

        await asyncio.gather(*(lane() for _ in range(in_flight)))
        return round(len(texts) / (time.perf_counter() - t0), 1)


def daemon_figures(texts: list[str], singles: int, cold_start: int) -> dict[str, Any]:
    daemon = Daemon(f"[pool]\ncold_start_workers = {cold_start}\n")
    try:
        daemon.wait_listening()
        listening = time.perf_counter() - daemon.started
        with Client(socket_path=daemon.socket) as c:
            c.embed("first")
            first_reply = time.perf_counter() - daemon.started
            status = c.status()
        pss_first = round(sum(daemon.pss_mb().values()), 1)
        model = next(m for m in status["models"] if m["key"] == MINILM)
        figures = {
            "cold_start_workers": cold_start,
            "start_to_listening_s": round(listening, 3),
            "start_to_first_embedding_s": round(first_reply, 3),
            "workers": len(model["workers"]),
            "pss_mb_after_first_reply": pss_first,
            "single": asyncio.run(latency_through(daemon.socket, texts[:singles])),
            "texts_per_s_64_in_flight": asyncio.run(
                throughput_through(daemon.socket, texts, 64)),
        }
        figures["pss_mb_busy"] = round(sum(daemon.pss_mb().values()), 1)
        time.sleep(2)  # idle workers return freed heap after 1 s (workers/main.py)
        figures["pss_mb"] = daemon.pss_mb()
        figures["pss_total_mb"] = round(sum(figures["pss_mb"].values()), 1)
        return figures
    finally:
        daemon.stop()


def cold_model_figures() -> dict[str, Any]:
    """A daemon already up (forkserver warm): first request to a cold model."""
    daemon = Daemon("[pool]\ncold_start_workers = 1\n")
    try:
        daemon.wait_listening()
        time.sleep(6)  # let the forkserver finish importing torch and transformers
        with Client(socket_path=daemon.socket) as c:
            t0 = time.perf_counter()
            c.embed("first")
            first = time.perf_counter() - t0
            load_s = next(w for m in c.status()["models"] if m["key"] == MINILM
                          for w in m["workers"])["load_s"]
        return {"cold_model_first_reply_s": round(first, 3), "weight_load_s": load_s,
                "overhead_s": round(first - (load_s or 0), 3)}
    finally:
        daemon.stop()


def embedding_figures(quick: bool) -> dict[str, Any]:
    texts = corpus(512 if quick else 2048)
    singles = 100 if quick else 400
    cpus = os.cpu_count() or 1
    # The daemon's default plan: cold_start_workers=1 -> one worker on every core;
    # cold_start_workers=2 -> two workers sharing the cores (supervisor.scaling.cpu_plan).
    base_all = baseline(texts, singles, threads=cpus)
    base_half = baseline(texts, singles, threads=max(1, cpus // 2))
    one = daemon_figures(texts, singles, cold_start=1)
    two = daemon_figures(texts, singles, cold_start=2)
    best = max(base_all["best_texts_per_s"], base_half["best_texts_per_s"])
    return {
        "texts": {"count": len(texts), "words": "8-40"},
        "in_process_all_threads": base_all,
        "in_process_half_threads": base_half,
        "daemon_1_worker_all_threads": one,
        "daemon_2_workers_half_threads": two,
        "cold_model": cold_model_figures(),
        "ratios": {
            "single_p50_overhead_ms_1w": round(one["single"]["p50_ms"]
                                               - base_all["single"]["p50_ms"], 3),
            "single_p50_overhead_ms_2w": round(two["single"]["p50_ms"]
                                               - base_half["single"]["p50_ms"], 3),
            "throughput_vs_best_in_process_1w": round(one["texts_per_s_64_in_flight"] / best, 3),
            "throughput_vs_best_in_process_2w": round(two["texts_per_s_64_in_flight"] / best, 3),
        },
    }


def pool_figures(quick: bool) -> dict[str, Any]:
    import bench_loads
    import bench_machine
    import bench_pool

    return {
        # The floor for the two p99 ratios below: no modelpool code, one idle-priority loop.
        "machine_idle_neighbour": bench_machine.idle_neighbour(
            3 if quick else 24, rounds=2 if quick else 8),
        # Long and many-windowed: a p99 from 8 s runs here varied 1.05-1.48x run to run.
        "loads_beside_traffic": bench_loads.loads_beside_traffic(
            3 if quick else 24, rounds=4 if quick else 12),
        "loads_beside_traffic_realtime": bench_loads.loads_beside_traffic(
            3 if quick else 24, rounds=4 if quick else 12, realtime=True),
        # Where no idle cgroup can be made (cgroup v2, no write access): SCHED_IDLE.
        "loads_beside_traffic_sched_idle": bench_loads.loads_beside_traffic(
            3 if quick else 24, rounds=4 if quick else 12, idle_cgroup=False),
        "starts_and_stops_beside_traffic": bench_loads.loads_beside_traffic(
            3 if quick else 8, other=bench_loads.NOOP_B),
        "extra_worker": bench_pool.extra_worker(),
        "extra_worker_with_weights_holder": bench_pool.extra_worker(holder=True),
        "extra_worker_bfloat16": bench_pool.extra_worker(dtype="bfloat16"),
        "extra_worker_bfloat16_with_weights_holder": bench_pool.extra_worker(
            holder=True, dtype="bfloat16"),
        "kill_recovery": bench_pool.kill_recovery(5 if quick else 20),
        "throughput_under_kills": bench_pool.throughput_under_kills(5 if quick else 10),
        "admission_dispatch": bench_pool.admission_dispatch_cost(20000 if quick else 100000),
        "supervisor_cost": bench_pool.supervisor_cost(5000 if quick else 20000),
        "queue_full_flood": bench_pool.queue_full_latency(20000 if quick else 100000),
    }


def jobs_figures(quick: bool) -> dict[str, Any]:
    import bench_jobs

    return {"noop_submit_retrieve": bench_jobs.noop_overhead(500 if quick else 3000),
            "minilm_as_jobs": bench_jobs.minilm_throughput(5000 if quick else 50000, 50),
            "followed_stream": bench_jobs.followed_stream(2000, 5 if quick else 15)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("embedding", "pool", "jobs", "cluster", "http",
                                           "targets", "generation", "rerank", "structured",
                                           "prefix"))
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "mem_gb": round(psutil.virtual_memory().total / 2**30)},
    }
    if args.only in (None, "targets"):
        import bench_targets  # issue 19: each target beside its in-process figure

        report["targets"] = bench_targets.figures(args.quick)
    if args.only in (None, "embedding"):
        report["embedding"] = embedding_figures(args.quick)
    if args.only in (None, "pool"):
        report["pool"] = pool_figures(args.quick)
    if args.only in (None, "jobs"):
        report["jobs"] = jobs_figures(args.quick)
    if args.only in (None, "http"):
        import bench_http

        report["http"] = bench_http.figures(args.quick)
    if args.only in (None, "cluster"):
        import bench_cluster

        report["cluster"] = bench_cluster.figures(args.quick)
    if args.only in (None, "generation"):
        import bench_generation

        report["generation"] = bench_generation.figures(args.quick)
    if args.only in (None, "rerank"):
        import bench_rerank

        report["rerank"] = bench_rerank.figures(args.quick)
    if args.only in (None, "structured"):
        import bench_structured

        report["structured"] = bench_structured.figures(args.quick)
    if args.only in (None, "prefix"):
        import bench_prefix

        report["prefix"] = bench_prefix.figures(args.quick)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
