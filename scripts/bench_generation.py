"""Generation figures for scripts/bench.py (`--only generation`): continuous batching.

For tiny-llm and a ~100M-parameter random-weight Llama that this script builds (into a
temporary directory, removed afterwards): 16 concurrent streams of 128 tokens
(ignore_eos, greedy, distinct prompts so none is deduplicated) on one worker that batches
them, against one stream alone on the same worker; time to first token at 16 and at 1,
for 16 streams started together and for 16 clients whose streams start while the
others are mid-way; and the same streams the way they ran before continuous batching,
through 16 one-at-a-time workers, with the memory (PSS) of each daemon meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import Daemon

from modelpool.protocol.client import AsyncClient, Client

STREAMS = 16
TOKENS = 128
PROMPT = "Once upon a time there was a little model that lived in a pool of workers"

MODEL = """
[[models]]
key = "llm"
capability = "text_to_text"
path = "{path}"
max_workers = {workers}
max_active_sequences = {sequences}
"""


def build_models(root: Path) -> dict[str, Path]:
    """tiny-llm (make_tiny_models.py) and llm-100m: 12 layers of 768, GQA 12/4 heads,
    tiny-llm's tokenizer, random weights, safetensors."""
    import make_tiny_models
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    make_tiny_models._quiet_transformers()
    tiny = make_tiny_models.build_model("tiny-llm", root)
    big = root / "llm-100m"
    big.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, big / name)
    small = json.loads((tiny / "config.json").read_text())
    ids = {k: small[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(vocab_size=small["vocab_size"], hidden_size=768,
                         intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                         num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=True, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(big, safe_serialization=True)
    return {"tiny-llm": tiny, "llm-100m": big}


async def _stream(c: AsyncClient, i: int, tokens: int) -> tuple[float, int]:
    """(time to first chunk, tokens) of one stream."""
    t0, first = time.perf_counter(), None
    async for chunk in c.generate(f"{PROMPT} {i}", model="llm", max_tokens=tokens,
                                  temperature=0, raw=True, ignore_eos=True, timeout_s=3600):
        if first is None and chunk.text:
            first = time.perf_counter() - t0
        if chunk.finish_reason:
            assert chunk.completion_tokens == tokens, chunk
    return first or 0.0, tokens


async def _round(sock: str, streams: int, offset: int, tokens: int = TOKENS
                 ) -> dict[str, Any]:
    async with AsyncClient(sock) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream(c, offset + i, tokens)
                                         for i in range(streams)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(n for _, n in results) / wall,
            "ttft_s": [t for t, _ in results]}


async def _steady(sock: str, lanes: int, rounds: int) -> dict[str, Any]:
    """`lanes` clients, each starting its next stream as soon as its last one ends, their
    first streams of staggered lengths: streams arrive while the others are mid-way, as
    on a server kept at that concurrency. Times to first token of the full streams."""
    async with AsyncClient(sock) as c:
        async def lane(i: int) -> list[tuple[float, int]]:
            done = [await _stream(c, 5000 + i, 1 + i * TOKENS // lanes)]
            for r in range(rounds):
                done.append(await _stream(c, 6000 + 100 * i + r, TOKENS))
            return done

        t0 = time.perf_counter()
        results = await asyncio.gather(*(lane(i) for i in range(lanes)))
        wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(n for r in results for _, n in r) / wall,
            "ttft_s": [t for r in results for t, _ in r[1:]]}


class PeakPss:
    """The daemon's whole process tree's PSS, sampled while a round runs."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon, self.peak, self._stop = daemon, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:  # every 0.2 s, and once more at the end
            if self._stop.wait(0.2):
                self.peak = max(self.peak, sum(self.daemon.pss_mb().values()))
                return
            self.peak = max(self.peak, sum(self.daemon.pss_mb().values()))

    def __enter__(self) -> PeakPss:
        # The first sample before the round: reading every process's smaps takes a core
        # for tens of milliseconds, which at a burst's start delayed its first tokens.
        self.peak = sum(self.daemon.pss_mb().values())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _serve(path: Path, workers: int, sequences: int,
           rounds: list[tuple[str, int]]) -> dict[str, list[dict[str, Any]]]:
    """Start a daemon for the model, warm its workers, run each round: ("burst", n) n
    streams started together, ("steady", n) n lanes of _steady."""
    daemon = Daemon(f"[pool]\ncold_start_workers = {workers}\ncooldown_idle_s = 3600\n"
                    + MODEL.format(path=path, workers=workers, sequences=sequences))
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.load("llm", workers=workers)
            while sum(w["state"] == "idle" for m in c.status()["models"] if m["key"] == "llm"
                      for w in m["workers"]) < workers:
                time.sleep(0.1)
        asyncio.run(_round(daemon.socket, min(workers * sequences, STREAMS), 1000, 4))  # warm
        out: dict[str, Any] = {}
        for n, (kind, streams) in enumerate(rounds):
            with PeakPss(daemon) as pss:
                result = asyncio.run(_round(daemon.socket, streams, 100 * n) if kind == "burst"
                                     else _steady(daemon.socket, streams, 2))
            out.setdefault(f"{kind}{streams}", []).append({**result,
                                                           "pss_mb": round(pss.peak, 1)})
        return out
    finally:
        daemon.stop()


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = sorted(t for r in runs for t in r["ttft_s"])
    return {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1),
            "pss_mb": max(r["pss_mb"] for r in runs), "runs": len(runs)}


def model_figures(path: Path, quick: bool) -> dict[str, Any]:
    runs = 1 if quick else 2
    burst, steady = ("burst", STREAMS), ("steady", STREAMS)
    batched = _serve(path, 1, STREAMS, [("burst", 1)] * (runs + 1) + [burst, steady] * runs)
    alone = _summary(batched["burst1"])
    together, staggered = _summary(batched["burst16"]), _summary(batched["steady16"])
    workers = _serve(path, STREAMS, 1, [burst, steady])
    today, today_steady = _summary(workers["burst16"]), _summary(workers["steady16"])
    return {
        "one_stream_alone": alone,
        f"{STREAMS}_streams_together_one_batching_worker": together,
        f"{STREAMS}_lanes_staggered_one_batching_worker": staggered,
        f"{STREAMS}_streams_together_{STREAMS}_one_at_a_time_workers": today,
        f"{STREAMS}_lanes_staggered_{STREAMS}_one_at_a_time_workers": today_steady,
        "throughput_ratio_vs_alone": round(together["tokens_per_s"] / alone["tokens_per_s"], 2),
        "ttft_p50_ratio_vs_alone_together": round(together["ttft_p50_ms"]
                                                  / alone["ttft_p50_ms"], 2),
        "ttft_p50_ratio_vs_alone_staggered": round(staggered["ttft_p50_ms"]
                                                   / alone["ttft_p50_ms"], 2),
        "throughput_ratio_vs_workers": round(together["tokens_per_s"] / today["tokens_per_s"], 2),
        "pss_ratio_vs_workers": round(together["pss_mb"] / today["pss_mb"], 3),
        "sequential_16_streams_s": round(STREAMS * TOKENS / alone["tokens_per_s"], 1),
    }


def figures(quick: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="mpbench-gen-"))
    try:
        paths = build_models(root)
        report: dict[str, Any] = {"streams": STREAMS, "tokens": TOKENS,
                                  "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
        for key, path in paths.items():
            report[key] = model_figures(path, quick)
        report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        return report
    finally:
        shutil.rmtree(root, ignore_errors=True)
