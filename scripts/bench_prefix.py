"""Prefix caching figures for scripts/bench.py (`--only prefix`).

One daemon serves the ~100M-parameter random-weight Llama of bench_generation twice: as
`llm` (its prefix cache on, the default) and as `llm-nocache` (prefix_cache_mb = 0), one
worker each. Lone chat requests, greedy, the two models in turn:

- a long system prompt (~1,000 tokens) shared by every request, each with its own short
  question: what an application with a fixed instruction block sends;
- a conversation of several turns, each sending the whole conversation so far (the
  model's own earlier answers included) with a new user message: what every chat does.

For each, time to first token (p50) with and without the cache, the prompt and the cached
tokens as the daemon reports them, and the answers compared (the same greedy text).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT, Daemon
from bench_generation import build_models

from modelpool.protocol.client import Client

MODELS = """
[pool]
cooldown_idle_s = 3600
[[models]]
key = "llm"
capability = "text_to_text"
path = "{path}"
max_workers = 1
[[models]]
key = "llm-nocache"
capability = "text_to_text"
path = "{path}"
max_workers = 1
options = {{ prefix_cache_mb = 0 }}
"""
QUESTIONS = ["rivers", "the pool of workers", "tokens and batches", "a quiet morning",
             "the lazy dog", "sea shells", "a thousand miles", "small sockets"]


def _instructions(words: int, start: int = 0) -> str:
    corpus = (ROOT / "scripts" / "tiny_corpus.txt").read_text().split()
    return " ".join(corpus[i % len(corpus)] for i in range(start, start + words))


def _ask(c: Client, model: str, messages: list[dict[str, str]], max_tokens: int
         ) -> dict[str, Any]:
    t0, first, parts, last = time.perf_counter(), None, [], None
    for chunk in c.generate(messages, model=model, max_tokens=max_tokens, temperature=0,
                            ignore_eos=True, timeout_s=600):
        if first is None:
            first = time.perf_counter() - t0
        parts.append(chunk.text)
        last = chunk
    assert last is not None and first is not None
    return {"ttft_s": first, "text": "".join(parts), "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens or 0}


def _shared_instructions(c: Client, quick: bool) -> dict[str, Any]:
    system = {"role": "system", "content": _instructions(600)}
    runs: dict[str, list[dict[str, Any]]] = {"llm": [], "llm-nocache": []}
    for model in runs:  # the first of each fills the cache: not timed
        _ask(c, model, [system, {"role": "user", "content": "hello"}], 4)
    for i, question in enumerate(QUESTIONS[:4] if quick else QUESTIONS):
        messages = [system, {"role": "user", "content": f"Tell me about {question}."}]
        for model in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            runs[model].append(_ask(c, model, messages, 4))
    return _compare(runs)


def _conversation(c: Client, quick: bool) -> dict[str, Any]:
    turns = 4 if quick else 6
    histories: dict[str, list[dict[str, str]]] = {
        model: [{"role": "system", "content": _instructions(150, start=300)}]
        for model in ("llm", "llm-nocache")}
    runs: dict[str, list[dict[str, Any]]] = {model: [] for model in histories}
    for turn in range(turns):
        for model in (list(runs) if turn % 2 == 0 else list(runs)[::-1]):
            history = histories[model]
            history.append({"role": "user", "content": _instructions(40 + turn)})
            answer = _ask(c, model, history, 48)
            history.append({"role": "assistant", "content": answer["text"]})
            runs[model].append(answer)
    return {**_compare({m: r[1:] for m, r in runs.items()}),  # the first turn caches nothing
            "prompt_tokens_by_turn": [r["prompt_tokens"] for r in runs["llm"]],
            "cached_tokens_by_turn": [r["cached_tokens"] for r in runs["llm"]],
            "ttft_ms_by_turn": {m: [round(1000 * r["ttft_s"], 1) for r in rs]
                                for m, rs in runs.items()}}


def _compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def p50(model: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[model])

    cached, uncached = 1000 * p50("llm", "ttft_s"), 1000 * p50("llm-nocache", "ttft_s")
    return {"requests": len(runs["llm"]), "prompt_tokens_p50": p50("llm", "prompt_tokens"),
            "cached_tokens_p50": p50("llm", "cached_tokens"),
            "uncached_reports_none": all(r["cached_tokens"] == 0 for r in runs["llm-nocache"]),
            "ttft_p50_ms_cached": round(cached, 1), "ttft_p50_ms_uncached": round(uncached, 1),
            "ttft_ratio_uncached_vs_cached": round(uncached / cached, 2),
            "same_answers": sum(a["text"] == b["text"]
                                for a, b in zip(runs["llm"], runs["llm-nocache"],
                                                strict=True))}


def figures(quick: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="mpbench-prefix-"))
    try:
        path = build_models(root)["llm-100m"]
        daemon = Daemon(MODELS.format(path=path))
        try:
            daemon.wait_listening()
            with Client(socket_path=daemon.socket) as c:
                report: dict[str, Any] = {
                    "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                    "shared_instructions": _shared_instructions(c, quick),
                    "conversation": _conversation(c, quick)}
            report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            return report
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
