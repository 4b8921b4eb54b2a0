"""Rerank on ONNX Runtime and on eager PyTorch, through the daemon and in this process.

    python scripts/bench.py --only rerank [--quick]

The model is a cross-encoder of MiniLM-L6's shape (BERT, 6 layers of 384, one relevance
logit) with random weights and the bundled MiniLM's tokenizer: nothing is downloaded,
and the speed is a real cross-encoder's of that shape (ms-marco-MiniLM-L-6-v2's). It is
built once into modelpool's cache directory, where its ONNX export is cached too.
Two daemons serve it, one on its export and one with execution = "eager"; lone (query,
document) pairs go through each and through both runtimes in this process (2 threads),
in blocks in turn (bench_targets explains why); then one query with 256 documents (one
worker's batches of max_batch) through each daemon, against this process's batches of
32, and eight queries of 32 documents in flight (the daemon's workers together).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench import WORDS, Daemon, percentiles
from bench_targets import in_turns

from modelpool.protocol.client import AsyncClient, Client

QUERY_WORDS, DOCUMENT_WORDS = (4, 10), (8, 40)
CONFIG = """
[[models]]
key = "cross-encoder"
capability = "rerank"
path = "{path}"
execution = "{execution}"
"""


def cross_encoder_dir() -> Path:
    """The random-weight cross-encoder, built on first use (its marker written last)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from modelpool.registry.content import cache_dir
    from modelpool.registry.download import resolve_model_dir
    from modelpool.registry.spec import Registry, load_catalog

    out = cache_dir() / "bench" / "cross-encoder-minilm-l6"
    if (out / "built").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    minilm = resolve_model_dir(Registry(load_catalog()).resolve("minilm"))  # type: ignore[arg-type]
    assert minilm is not None
    torch.manual_seed(0)
    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        if (minilm / name).exists():
            shutil.copy(minilm / name, out / name)
    (out / "built").touch()
    return out


def _pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)

    def text(words: tuple[int, int]) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))

    return [(text(QUERY_WORDS), text(DOCUMENT_WORDS)) for _ in range(count)]


def _in_process(path: Path, execution: str) -> Any:
    import torch

    from modelpool.registry.loaders import load_model
    from modelpool.registry.spec import ModelSpec

    torch.set_num_threads(2)
    model = load_model(ModelSpec(key="cross-encoder", capability="rerank", path=str(path),
                                 execution=execution))  # type: ignore[arg-type]
    if hasattr(model, "set_threads"):
        model.set_threads(2)
    return model


def _pairs_per_s(score: Any, query: str, documents: list[str], rounds: int = 2) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        score(query, documents)
        best = min(best, time.perf_counter() - started)
    return round(len(documents) / best, 1)


def _queries_in_flight(sock: str, documents: list[str], queries: int = 8) -> float:
    """Pairs per second for `queries` queries of 32 documents each, all in flight."""
    async def run() -> float:
        async with AsyncClient(sock) as c:
            started = time.perf_counter()
            await asyncio.gather(*(c.rerank(f"query {i}", documents[:32])
                                   for i in range(queries)))
            return time.perf_counter() - started

    best = min(asyncio.run(run()) for _ in range(2))
    return round(queries * 32 / best, 1)


def _batched(model: Any) -> Any:
    def score(query: str, documents: list[str]) -> np.ndarray:
        return np.concatenate([model.score([(query, d) for d in documents[i : i + 32]])
                               for i in range(0, len(documents), 32)])
    return score


def figures(quick: bool) -> dict[str, Any]:
    path = cross_encoder_dir()
    models = {execution: _in_process(path, execution) for execution in ("onnx", "eager")}
    daemons = {e: Daemon(CONFIG.format(path=path, execution=e)) for e in ("onnx", "eager")}
    try:
        for daemon in daemons.values():
            daemon.wait_listening()
        clients = {e: Client(socket_path=d.socket) for e, d in daemons.items()}
        for client in clients.values():
            client.rerank("warm", ["up"] * 4, timeout_s=300)
        pairs = _pairs(60 if quick else 300)
        runs = {f"daemon_{e}": (lambda p, c=c: c.rerank(p[0], [p[1]])) for e, c in clients.items()}
        runs |= {f"in_process_{e}": (lambda p, m=m: m.score([p])) for e, m in models.items()}
        single = {who: percentiles(samples)
                  for who, samples in in_turns(runs, pairs, block=20)[0].items()}
        query, documents = "what does a worker do", [d for _, d in _pairs(256, seed=1)]
        many = {f"daemon_{e}": _pairs_per_s(c.rerank, query, documents)
                for e, c in clients.items()}
        many |= {f"in_process_{e}": _pairs_per_s(_batched(m), query, documents)
                 for e, m in models.items()}
        in_flight = {f"daemon_{e}": _queries_in_flight(d.socket, documents)
                     for e, d in daemons.items()}
        error = float(np.abs(clients["onnx"].rerank(query, documents)
                             - _batched(models["eager"])(query, documents)).max())
        executions = {e: [w["info"].get("execution") for m in c.status()["models"]
                          if m["key"] == "cross-encoder" for w in m["workers"]]
                      for e, c in clients.items()}
        for client in clients.values():
            client.close()
    finally:
        for daemon in daemons.values():
            daemon.stop()
    eager_p50 = single["in_process_eager"]["p50_ms"]
    return {
        "model": "BERT 6x384, one logit, random weights, MiniLM's tokenizer",
        "executions": executions, "onnx_reason": models["onnx"].info()["execution_reason"],
        "lone_pair": single, "pairs_per_s_256_documents": many,
        "pairs_per_s_8_queries_of_32_in_flight": in_flight,
        "max_score_difference_daemon_onnx_vs_in_process_eager": error,
        "ratios": {
            "lone_pair_daemon_onnx_vs_in_process_eager": round(
                single["daemon_onnx"]["p50_ms"] / eager_p50, 3),
            "lone_pair_daemon_eager_minus_in_process_eager_ms": round(
                single["daemon_eager"]["p50_ms"] - eager_p50, 3),
            "pairs_per_s_daemon_onnx_vs_in_process_eager": round(
                many["daemon_onnx"] / many["in_process_eager"], 3),
            "pairs_per_s_8_in_flight_daemon_onnx_vs_in_process_eager": round(
                in_flight["daemon_onnx"] / many["in_process_eager"], 3),
        },
    }
