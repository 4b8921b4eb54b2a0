"""Sentence embeddings run by ONNX Runtime from a cached export. Free of torch.

The exported graph takes the tokenizer's arrays and returns the pooled (and, as the model
says, normalised) vectors, so a forward pass is one `session.run`. The weights are an
external data file that ONNX Runtime maps, so every worker of the model shares them from
the page cache. Before it serves, a loaded export embeds the reference texts and must
give eager PyTorch's vectors for them (recorded at export) within MIN_COSINE.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelpool.registry.loaders import onnx_cache
from modelpool.registry.loaders.onnx_cache import Manifest

MIN_COSINE = 0.9999
LONG_CHARS = 200  # reference texts this long are embedded alone
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


class VectorsDiffer(Exception):
    """The export's vectors are not eager PyTorch's: never serve it."""


class OnnxEmbedder:
    """One ONNX Runtime session per intra-op thread count asked for (see set_threads):
    a worker has two at most, its share of the cores and all of them."""

    def __init__(self, entry: Path, manifest: Manifest, threads: int) -> None:
        from tokenizers import Tokenizer

        self.entry = entry
        self.manifest = manifest
        self.tokenizer = Tokenizer.from_file(str(entry / onnx_cache.TOKENIZER_FILE))
        self.max_seq_length = manifest.max_seq_length
        self.dim = manifest.dim
        self.sessions: dict[int, Any] = {}
        self.cpus = len(os.sched_getaffinity(0))
        self.threads = max(1, threads or self.cpus)
        self.session = self._session(self.threads)

    def info(self) -> dict[str, Any]:
        return {"dim": self.dim, "max_seq_length": self.max_seq_length, "execution": "onnx",
                "execution_reason": self.manifest.reason}

    def set_threads(self, threads: int) -> None:
        """Run the next forward passes on this many intra-op threads."""
        if threads != self.threads:
            self.threads = threads
            self.session = self._session(threads)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_counted(texts)[0]

    def embed_counted(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """The vectors, and the tokens each text was read as (usage figures)."""
        if self.manifest.lowercase:
            texts = [t.lower() for t in texts]
        encodings = self.tokenizer.encode_batch(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        masks = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids}
        if "attention_mask" in self.manifest.inputs:
            feeds["attention_mask"] = masks
        if "token_type_ids" in self.manifest.inputs:
            feeds["token_type_ids"] = np.array([e.type_ids for e in encodings], dtype=np.int64)
        vectors = np.asarray(self.session.run(None, feeds)[0], dtype=np.float32)
        return vectors, masks.sum(axis=1).tolist()

    def verify(self) -> float:
        """The smallest cosine between this export's vectors and eager PyTorch's for the
        reference texts, one batch and one at a time; VectorsDiffer below MIN_COSINE."""
        reference = np.load(self.entry / onnx_cache.REFERENCE_FILE)
        short = [i for i, text in enumerate(REFERENCE_TEXTS) if len(text) < LONG_CHARS]
        alone = [*short[:2], *(i for i in range(len(REFERENCE_TEXTS)) if i not in short)]
        cosines = [_cosines(reference[short], self.embed([REFERENCE_TEXTS[i] for i in short]))]
        # Singles too (no padding), the long text among them: a batch of it would pad
        # every row to max_seq_length (~1 s here).
        cosines += [_cosines(reference[i : i + 1], self.embed([REFERENCE_TEXTS[i]]))
                    for i in alone]
        cosine = float(min(c.min() for c in cosines))
        if not np.isfinite(cosine) or cosine < MIN_COSINE:
            raise VectorsDiffer(f"ONNX vectors differ from eager PyTorch's (cosine "
                                f"{cosine:.6f} < {MIN_COSINE})")
        return cosine

    def _session(self, threads: int) -> Any:
        if threads not in self.sessions:
            self.sessions[threads] = new_session(self.entry / onnx_cache.MODEL_FILE, threads)
        return self.sessions[threads]


def new_session(model_file: Path, threads: int) -> Any:
    """A session on `threads` intra-op threads. Its weights, and their layouts prepacked
    for this CPU at export, are mapped from the cache: every session of every worker
    shares one copy from the page cache."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Between the parallel parts of a pass its threads spin instead of sleeping: waking
    # a sleeping thread for each part cost a lone MiniLM text ~1-2 ms of ~9 here. They
    # stop when the pass ends: spinning on, they would take the cores its siblings and
    # the supervisor need (~60 ms of CPU after a last pass, without the stop).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    # No arena: activations go back to malloc, and an idle worker trims them (main.py).
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    return ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])


def open_entry(entry: Path, manifest: Manifest, threads: int) -> OnnxEmbedder:
    """The cached export, checked against eager PyTorch's reference vectors."""
    embedder = OnnxEmbedder(entry, manifest, threads)
    embedder.verify()
    return embedder


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)
