"""What every model run by ONNX Runtime from a cached export shares: its tokenizer, its
sessions (one per intra-op thread count) and how a batch of encodings is fed to the
graph. Free of torch."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from modelpool.registry.loaders import onnx_cache
from modelpool.registry.loaders.onnx_cache import Manifest

LONG_CHARS = 200  # reference inputs this long are checked alone


class OutputsDiffer(Exception):
    """The export's outputs are not eager PyTorch's: never serve it."""


class OnnxRunner:
    """One ONNX Runtime session per intra-op thread count asked for (see set_threads):
    a worker has two at most, its share of the cores and all of them."""

    def __init__(self, entry: Path, manifest: Manifest, threads: int) -> None:
        from tokenizers import Tokenizer

        self.entry = entry
        self.manifest = manifest
        self.tokenizer = Tokenizer.from_file(str(entry / onnx_cache.TOKENIZER_FILE))
        self.sessions: dict[int, Any] = {}
        self.cpus = len(os.sched_getaffinity(0))
        self.threads = max(1, threads or self.cpus)
        self.session = self._session(self.threads)

    @classmethod
    def open_checked(cls, entry: Path, manifest: Manifest, threads: int) -> Self:
        """The cached export, checked against eager PyTorch's reference outputs."""
        runner = cls(entry, manifest, threads)
        runner.verify()
        return runner

    def set_threads(self, threads: int) -> None:
        """Run the next forward passes on this many intra-op threads."""
        if threads != self.threads:
            self.threads = threads
            self.session = self._session(threads)

    def verify(self) -> float:
        """How close the export's outputs for the reference inputs are to eager PyTorch's;
        OutputsDiffer when they are not close enough to serve."""
        raise NotImplementedError

    def run(self, encodings: Sequence[Any]) -> np.ndarray:
        """The graph's output for these encodings (of one padded batch)."""
        feeds = {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64)}
        if "attention_mask" in self.manifest.inputs:
            feeds["attention_mask"] = np.array([e.attention_mask for e in encodings],
                                               dtype=np.int64)
        if "token_type_ids" in self.manifest.inputs:
            feeds["token_type_ids"] = np.array([e.type_ids for e in encodings],
                                               dtype=np.int64)
        return np.asarray(self.session.run(None, feeds)[0], dtype=np.float32)

    def reference(self) -> np.ndarray:
        """Eager PyTorch's outputs for the reference inputs, recorded at export."""
        return np.load(self.entry / onnx_cache.REFERENCE_FILE)

    def _session(self, threads: int) -> Any:
        if threads not in self.sessions:
            self.sessions[threads] = new_session(self.entry / onnx_cache.MODEL_FILE, threads)
        return self.sessions[threads]


def check_groups(lengths: Sequence[int]) -> list[list[int]]:
    """The reference inputs' indices as an export is checked: the short ones in one
    batch, then two of them and every long one alone (no padding). A batch holding a long
    one would pad every row to the model's limit (~1 s here for MiniLM)."""
    short = [i for i, length in enumerate(lengths) if length < LONG_CHARS]
    alone = [*short[:2], *(i for i in range(len(lengths)) if i not in short)]
    return [short, *([i] for i in alone)]


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
