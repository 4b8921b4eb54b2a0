"""Custom loaders for scripts/bench.py: a model that costs nothing, to measure the
supervisor alone, and a slow one. Plugged in with `loader = "bench_loaders:..."`."""

from __future__ import annotations

import time
from collections.abc import Sequence
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
