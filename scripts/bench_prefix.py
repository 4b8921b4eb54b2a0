"""Prefix caching figures for scripts/bench.py (`--only prefix`).

One daemon serves the ~100M-parameter random-weight Llama of bench_generation twice: as
`llm` (its prefix cache on, the default) and as `llm-nocache` (prefix_cache_mb = 0), one
worker each. Lone chat requests, greedy, the two models in turn:

- a long system prompt (~1,000 tokens) shared by every request, each with its own short
  question: what an application with a fixed instruction block sends;
- a conversation of several turns, each sending the whole conversation so far (the
  model's own earlier answers included) with a new user message: what every chat does;
- four choices of one prompt sent at once, each sampled with its own seed (what the HTTP
  API's `n` = 4 sends), a new prompt each round: with the cache its prefill runs once.
- eight requests sent at once with the same instructions (a new ~300-word block each
  round) and their own questions: with the cache the first is prefilled, the others'
  questions together from its kept prompt.

For each, time to first token (p50) with and without the cache, the prompt and the cached
tokens as the daemon reports them, and the answers compared (the same greedy text).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT, Daemon
from bench_generation import build_models

from modelpool.protocol.client import AsyncClient, Client

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


async def _together(socket: str, quick: bool, questions: list[str],
                    words: int) -> dict[str, Any]:
    """Requests sent at once, one per question (the same question: seeds 0, 1, ...), the
    same instructions for all (new each round): time until every one has its first
    token, and until all end."""
    async def one(c: AsyncClient, model: str, messages: list[dict[str, str]],
                  seed: int, t0: float) -> tuple[float, float]:
        first = None
        async for _ in c.generate(messages, model=model, max_tokens=16, temperature=1.0,
                                  seed=seed, ignore_eos=True, timeout_s=600):
            first = first or time.perf_counter() - t0
        assert first is not None
        return first, time.perf_counter() - t0

    runs: dict[str, list[tuple[float, float]]] = {"llm": [], "llm-nocache": []}
    async with AsyncClient(socket) as c:
        for round_ in range(3 if quick else 6):
            system = {"role": "system",
                      "content": _instructions(words, 2000 + 97 * len(questions) * round_)}
            for model in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
                t0 = time.perf_counter()
                times = await asyncio.gather(*(
                    one(c, model, [system, {"role": "user", "content": question}], seed, t0)
                    for seed, question in enumerate(questions)))
                runs[model].append((max(f for f, _ in times), max(e for _, e in times)))

    def p50(model: str, which: int) -> float:
        return round(1000 * statistics.median(r[which] for r in runs[model]), 1)

    return {"rounds": len(runs["llm"]),
            "all_first_tokens_p50_ms": {m: p50(m, 0) for m in runs},
            "all_done_p50_ms": {m: p50(m, 1) for m in runs},
            "first_tokens_ratio_uncached_vs_cached": round(p50("llm-nocache", 0)
                                                           / p50("llm", 0), 2)}


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
                    "conversation": _conversation(c, quick),
                    "four_choices": asyncio.run(_together(
                        daemon.socket, quick, ["Tell me a story."] * 4, 250)),
                    "eight_questions_at_once": asyncio.run(_together(
                        daemon.socket, quick, [f"Tell me about {q}." for q in QUESTIONS],
                        300))}
            report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            return report
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
