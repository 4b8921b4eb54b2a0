"""Cross-encoders for rerank run by ONNX Runtime from a cached export. Free of torch.

The exported graph takes a batch of tokenized (query, document) pairs and returns their
scores, activated as the eager cross-encoder does it (registry/loaders/cross_encoder.py).
Before it serves, a loaded export scores the reference pairs and must give eager
PyTorch's scores for them (recorded at export) within MAX_SCORE_ERROR.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelpool.registry.loaders.onnx_cache import Manifest
from modelpool.registry.loaders.onnx_session import OnnxRunner, OutputsDiffer, check_groups

# A score may differ from eager PyTorch's by this much (times the score, above 1): float32
# kernels in another order differ by ~1e-6 here; a wrong graph, by far more.
MAX_SCORE_ERROR = 1e-4
_QUERY = "what does a worker process do"
REFERENCE_PAIRS = (
    (_QUERY, "A worker process keeps one model loaded and serves many clients."),
    (_QUERY, "short"),
    (_QUERY, "the quick brown fox jumps over the lazy dog " * 3),
    ("Ünïcödé query 🙂", "Ünïcödé, émojis 🙂 and numbers 3.14159 in one sentence."),
    ("what is the capital of France?", "Paris is the capital and largest city of France."),
    ("what is the capital of France?", "x " * 600),  # past any max_length: truncation
    ("q " * 400, "d " * 400),  # both long: truncation takes from the longer first
)


class ScoresDiffer(OutputsDiffer):
    """The export's scores are not eager PyTorch's: never serve it."""


class OnnxReranker(OnnxRunner):
    def __init__(self, entry: Path, manifest: Manifest, threads: int) -> None:
        super().__init__(entry, manifest, threads)
        self.max_length = manifest.max_seq_length

    def info(self) -> dict[str, Any]:
        return {"max_length": self.max_length, "activation": self.manifest.activation,
                "execution": "onnx", "execution_reason": self.manifest.reason}

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        # Pairs longer than max_length lose tokens from the longer of the two first, as
        # eager's (the tokenizer saved at export truncates "longest_first").
        return self.run(self.tokenizer.encode_batch(list(pairs))).reshape(-1)

    def verify(self) -> float:
        """The largest difference between this export's scores and eager PyTorch's for
        the reference pairs (relative above 1), in one batch and one at a time;
        ScoresDiffer above MAX_SCORE_ERROR."""
        reference = self.reference()
        groups = check_groups([len(q) + len(d) for q, d in REFERENCE_PAIRS])
        error = float(max(
            _errors(reference[group], self.score([REFERENCE_PAIRS[i] for i in group])).max()
            for group in groups))
        if not np.isfinite(error) or error > MAX_SCORE_ERROR:
            raise ScoresDiffer(f"ONNX scores differ from eager PyTorch's (by {error:.2e} > "
                               f"{MAX_SCORE_ERROR})")
        return error


def _errors(expected: np.ndarray, got: np.ndarray) -> np.ndarray:
    return np.abs(got - expected) / np.maximum(np.abs(expected), 1.0)
