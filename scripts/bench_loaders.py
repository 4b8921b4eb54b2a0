"""Custom loaders for scripts/bench.py: a model that costs nothing, to measure the
supervisor alone (or a slow one), and a generator that streams a token per step.
Plugged in with `loader = "bench_loaders:..."`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelpool.registry.spec import ModelSpec


class NoopEmbedder:
    def __init__(self, run_s: float) -> None:
        self.run_s = run_s

    def info(self) -> dict[str, Any]:
        return {"dim": 4}

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if self.run_s:
            time.sleep(self.run_s)
        return np.zeros((len(texts), 4), dtype=np.float32)


def noop(spec: ModelSpec, model_dir: Path | None) -> NoopEmbedder:
    return NoopEmbedder(float(spec.options.get("run_s", 0)))


class Ticker:
    """Streams "tok0 tok1 ..." one token per step_s seconds, each as made."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def info(self) -> dict[str, Any]:
        return {"context": 1 << 20}

    def generate(self, request: Any, stats: Any) -> Iterator[str]:
        for i in range(request.sampling.max_tokens or 0):
            time.sleep(self.step_s)
            stats.completion_tokens += 1
            yield f"tok{i} "
        stats.finish_reason = "length"


def ticker(spec: ModelSpec, model_dir: Path | None) -> Ticker:
    return Ticker(float(spec.options.get("step_s", 0)))
