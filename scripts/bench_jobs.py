"""Benchmarks of the job API against direct calls, measured in the same run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench import MINILM, Daemon, corpus, percentiles
from bench_pool import NOOP

from modelpool.protocol.client import AsyncClient, Client


def noop_overhead(rounds: int) -> dict[str, Any]:
    """One at a time, a model that costs nothing: a direct call's round trip against a
    submit followed by a retrieve of the same request."""
    daemon = Daemon("[pool]\ncold_start_workers = 1\n" + NOOP.format(run_s=0, max_queue=1000))
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.embed("warm", model="noop")
            direct, jobs = [], []
            for i in range(rounds):  # interleaved, so drift hits both alike
                t0 = time.perf_counter()
                c.embed(f"d{i}", model="noop")
                t1 = time.perf_counter()
                c.retrieve(c.submit("embed", f"j{i}", model="noop"))
                t2 = time.perf_counter()
                direct.append(t1 - t0)
                jobs.append(t2 - t1)
        skip = rounds // 10
        d, j = percentiles(direct[skip:]), percentiles(jobs[skip:])
        return {"direct": d, "submit_and_retrieve": j,
                "p50_overhead_ms": round(j["p50_ms"] - d["p50_ms"], 3)}
    finally:
        daemon.stop()


def minilm_throughput(texts: int, per_job: int) -> dict[str, Any]:
    """The same texts as jobs of per_job texts, submitted first and retrieved after, and
    as direct calls of one text, 64 in flight."""
    daemon = Daemon("[pool]\ncooldown_idle_s = 3600\n")
    sentences = corpus(texts, seed=1)
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.load(MINILM, workers=2)
            c.embed(["warm"] * 64)

        async def direct() -> float:
            async with AsyncClient(daemon.socket) as c:
                queue = list(sentences)

                async def lane() -> None:
                    while queue:
                        await c.embed(queue.pop())

                t0 = time.perf_counter()
                await asyncio.gather(*(lane() for _ in range(64)))
                return texts / (time.perf_counter() - t0)

        async def as_jobs() -> float:
            async with AsyncClient(daemon.socket) as c:
                t0 = time.perf_counter()
                keys = [await c.submit("embed", sentences[i:i + per_job], priority="batch")
                        for i in range(0, texts, per_job)]
                for key in keys:
                    await c.retrieve(key, timeout_s=600)
                return texts / (time.perf_counter() - t0)

        direct_rate = asyncio.run(direct())
        jobs_rate = asyncio.run(as_jobs())
        return {"texts": texts, "texts_per_job": per_job,
                "direct_64_in_flight_texts_per_s": round(direct_rate, 1),
                "jobs_texts_per_s": round(jobs_rate, 1),
                "ratio": round(jobs_rate / direct_rate, 3)}
    finally:
        daemon.stop()


TICKER = """
[[models]]
key = "ticker"
capability = "text_to_text"
loader = "bench_loaders:ticker"
options = { step_s = 0 }
max_workers = 1
"""


def followed_stream(tokens: int, rounds: int) -> dict[str, Any]:
    """A generation streamed as a direct call against the same submitted as a job with
    `stream` and followed live (its chunks kept, then sent on), and followed again once
    ended (the kept chunks replayed), a model that costs nothing a token; interleaved."""
    daemon = Daemon("[pool]\ncold_start_workers = 1\n" + TICKER)
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            list(c.generate("warm", model="ticker", max_tokens=8))
            times: dict[str, list[float]] = {"direct": [], "followed": [], "again": []}
            for _ in range(rounds):
                t0 = time.perf_counter()
                list(c.generate("go", model="ticker", max_tokens=tokens))
                t1 = time.perf_counter()
                key = c.submit("generate", "go", model="ticker", max_tokens=tokens,
                               stream=True)
                list(c.follow(key))
                t2 = time.perf_counter()
                list(c.follow(key))
                times["direct"].append(t1 - t0)
                times["followed"].append(t2 - t1)
                times["again"].append(time.perf_counter() - t2)
        p50 = {name: sorted(s)[len(s) // 2] for name, s in times.items()}
        return {"tokens": tokens, "rounds": rounds,
                **{f"{name}_p50_ms": round(s * 1e3, 2) for name, s in p50.items()},
                "followed_over_direct": round(p50["followed"] / p50["direct"], 3),
                "followed_us_per_token_more": round(
                    (p50["followed"] - p50["direct"]) / tokens * 1e6, 2)}
    finally:
        daemon.stop()
