"""Sentence embeddings run by ONNX Runtime from a cached export. Free of torch.

The exported graph takes the tokenizer's arrays and returns the pooled (and, as the model
says, normalised) vectors, so a forward pass is one `session.run`. The weights are an
external data file that ONNX Runtime maps, so every worker of the model shares them from
the page cache. Before it serves, a loaded export embeds the reference texts and must
give eager PyTorch's vectors for them (recorded at export) within MIN_COSINE.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelpool.registry.loaders.onnx_cache import Manifest
from modelpool.registry.loaders.onnx_session import OnnxRunner, OutputsDiffer, check_groups

MIN_COSINE = 0.9999
REFERENCE_TEXTS = (
    "hello world",
    "A worker process keeps one model loaded and serves many clients.",
    "the quick brown fox jumps over the lazy dog " * 3,
    "Ünïcödé, émojis 🙂 and numbers 3.14159 in one sentence.",
    "short",
    "Embeddings of queries and documents are compared by cosine similarity; "
    "a pooled vector summarises the tokens.",
    "x " * 600,  # longer than any max_seq_length: truncation must agree
    "What is the capital of France? Paris is the capital and largest city of France.",
)


class VectorsDiffer(OutputsDiffer):
    """The export's vectors are not eager PyTorch's: never serve it."""


class OnnxEmbedder(OnnxRunner):
    def __init__(self, entry: Path, manifest: Manifest, threads: int) -> None:
        super().__init__(entry, manifest, threads)
        self.max_seq_length = manifest.max_seq_length
        self.dim = manifest.dim
        self.matryoshka_dimensions: list[int] | None = None  # set by encoder_exec.load

    def info(self) -> dict[str, Any]:
        info = {"dim": self.dim, "max_seq_length": self.max_seq_length, "execution": "onnx",
                "execution_reason": self.manifest.reason}
        if self.matryoshka_dimensions is not None:
            info["matryoshka_dimensions"] = self.matryoshka_dimensions
        return info

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_counted(texts)[0]

    def embed_counted(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """The vectors, and the tokens each text was read as (usage figures)."""
        if self.manifest.lowercase:
            texts = [t.lower() for t in texts]
        encodings = self.tokenizer.encode_batch(list(texts))
        return self.run(encodings), [sum(e.attention_mask) for e in encodings]

    def verify(self) -> float:
        """The smallest cosine between this export's vectors and eager PyTorch's for the
        reference texts, one batch and one at a time; VectorsDiffer below MIN_COSINE."""
        reference = self.reference()
        groups = check_groups([len(text) for text in REFERENCE_TEXTS])
        cosine = float(min(
            _cosines(reference[group], self.embed([REFERENCE_TEXTS[i] for i in group])).min()
            for group in groups))
        if not np.isfinite(cosine) or cosine < MIN_COSINE:
            raise VectorsDiffer(f"ONNX vectors differ from eager PyTorch's (cosine "
                                f"{cosine:.6f} < {MIN_COSINE})")
        return cosine


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)
