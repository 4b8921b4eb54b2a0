"""Export an encoder model to ONNX once, check it, time it, and cache it: a sentence
embedder (its vectors) or a rerank cross-encoder (its scores).

Runs in a process of its own: forked from the daemon's forkserver
(onnx_cache.export_forked), or `python -m modelpool.registry.loaders.onnx_export` with
the spec on stdin, started by a worker whose model has no cache entry yet. The export
leaves ~100 MiB of heap behind, none of which a worker should keep. The graph is the
transformer followed by what the eager loader does with its output (pooling and
normalisation; the relevance logit and its activation), exported with torch's standard
exporter, then fused and optimised once by ONNX Runtime and saved with its weights in
an external file (which every worker maps). Eager PyTorch's outputs for the reference
inputs are stored beside it: every later load checks the export against them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from modelpool.registry.loaders import onnx_cache, onnx_embedding, onnx_fusion, onnx_rerank
from modelpool.registry.loaders.cross_encoder import CrossEncoder
from modelpool.registry.loaders.onnx_cache import Manifest
from modelpool.registry.loaders.onnx_session import LONG_CHARS, OnnxRunner, OutputsDiffer
from modelpool.registry.loaders.sentence_embedding import SentenceEmbedder, pool
from modelpool.registry.spec import ModelSpec

log = logging.getLogger("modelpool.onnx")
OPSET = 17
TIMING_ROUNDS = 5
SLOWER = 1.2  # "auto" keeps eager PyTorch when the export takes longer than this x eager


class _Pooled(torch.nn.Module):
    """The transformer, pooled and normalised as SentenceEmbedder does it."""

    def __init__(self, embedder: SentenceEmbedder, inputs: list[str]) -> None:
        super().__init__()
        self.model = embedder.model
        self.pooling = embedder.pooling
        self.normalize = embedder.normalize
        self.inputs = inputs

    def forward(self, *arrays: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.inputs, arrays, strict=True))
        hidden = self.model(**named).last_hidden_state
        pooled = pool(hidden, named["attention_mask"], self.pooling)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled


class _Scored(torch.nn.Module):
    """The cross-encoder's relevance logit, activated as CrossEncoder.score does it."""

    def __init__(self, encoder: CrossEncoder, inputs: list[str]) -> None:
        super().__init__()
        self.model = encoder.model
        self.sigmoid = encoder.activation == "sigmoid"
        self.inputs = inputs

    def forward(self, *arrays: torch.Tensor) -> torch.Tensor:
        logits = self.model(**dict(zip(self.inputs, arrays, strict=True))).logits[:, 0]
        return torch.sigmoid(logits) if self.sigmoid else logits


class _Kind:
    """What an export takes from its eager model; each capability's below."""

    output: str  # the graph's output
    method: str  # what runs a model, eager or exported, on a list of samples
    samples: tuple[Any, ...]  # the reference inputs
    runner: type[OnnxRunner]
    check, check_field = "", ""  # the check's words (a format) and its manifest field

    def __init__(self, eager: Any, max_length: int) -> None:
        self.eager, self.model, self.tokenizer = eager, eager.model, eager.tokenizer
        self.max_length = max_length

    def checked(self, value: float) -> tuple[str, dict[str, float]]:
        return self.check.format(value), {self.check_field: value}

    def tokenize(self, samples: list[Any]) -> Any:
        """Samples as eager's tokenizer makes them (torch tensors)."""
        raise NotImplementedError

    def graph(self, inputs: list[str]) -> torch.nn.Module:
        """What is exported: the model and what eager does with its output."""
        raise NotImplementedError

    def manifest(self, inputs: list[str]) -> Manifest:
        """The entry's manifest before the export is checked and timed."""
        raise NotImplementedError


class _Embedder(_Kind):
    output, method, samples = "vectors", "embed", onnx_embedding.REFERENCE_TEXTS
    runner = onnx_embedding.OnnxEmbedder
    check, check_field = "min cosine {:.6f}", "min_cosine"

    def __init__(self, spec: ModelSpec, model_dir: Path) -> None:
        from modelpool.registry.loaders import sentence_embedding

        eager: SentenceEmbedder = sentence_embedding.load(spec, model_dir)
        super().__init__(eager, eager.max_seq_length)

    def tokenize(self, texts: list[str]) -> Any:
        return self.tokenizer(texts, padding=True, truncation=True,
                              max_length=self.max_length, return_tensors="pt")

    def graph(self, inputs: list[str]) -> torch.nn.Module:
        return _Pooled(self.eager, inputs)

    def manifest(self, inputs: list[str]) -> Manifest:
        return Manifest(choice="onnx", reason="", inputs=inputs, lowercase=self.eager.lowercase,
                        max_seq_length=self.max_length, dim=self.eager.dim)


class _Reranker(_Kind):
    output, method, samples = "scores", "score", onnx_rerank.REFERENCE_PAIRS
    runner = onnx_rerank.OnnxReranker
    check, check_field = "max score error {:.1e}", "max_score_error"

    def __init__(self, spec: ModelSpec, model_dir: Path) -> None:
        from modelpool.registry.loaders import cross_encoder

        eager: CrossEncoder = cross_encoder.load(spec, model_dir)
        super().__init__(eager, eager.max_length)

    def tokenize(self, pairs: list[tuple[str, str]]) -> Any:
        return self.tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True,
                              truncation=True, max_length=self.max_length,
                              return_tensors="pt")

    def graph(self, inputs: list[str]) -> torch.nn.Module:
        return _Scored(self.eager, inputs)

    def manifest(self, inputs: list[str]) -> Manifest:
        return Manifest(choice="onnx", reason="", inputs=inputs,
                        max_seq_length=self.max_length, activation=self.eager.activation)


KINDS: dict[str, type[_Embedder] | type[_Reranker]] = {
    "text_embedding": _Embedder, "rerank": _Reranker}


def export_entry(spec: ModelSpec, model_dir: Path, entry: Path) -> Manifest:
    """Make the cache entry (or find that another process just made it); its manifest."""
    with onnx_cache.exporting(entry) as work:
        if work is None:
            manifest = onnx_cache.read_manifest(entry)
            assert manifest is not None
            return manifest
        kind = KINDS[spec.capability](spec, model_dir)
        try:
            manifest = _export(kind, work)
        except Exception as exc:  # an architecture the exporter cannot trace, ...
            log.warning("model %r: ONNX export failed, running eager PyTorch: %s: %s",
                        spec.key, type(exc).__name__, exc)
            manifest = Manifest(choice="eager", reason=f"export failed: {exc}"[:300])
        (work / onnx_cache.MANIFEST).write_bytes(msgspec.json.encode(manifest))
        return manifest


def _export(kind: _Kind, work: Path) -> Manifest:
    eager_run = getattr(kind.eager, kind.method)
    np.save(work / onnx_cache.REFERENCE_FILE, eager_run(list(kind.samples)))
    sample = kind.tokenize(list(kind.samples[:2]))
    inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids")
              if name in sample]
    raw = work / "raw.onnx"
    # The tracer warns about Python branches on shapes; the check below is what counts.
    with torch.inference_mode(), warnings.catch_warnings(), _eager_attention(kind.model):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            kind.graph(inputs).eval(), tuple(sample[name] for name in inputs), str(raw),
            dynamo=False, opset_version=OPSET, input_names=inputs, output_names=[kind.output],
            dynamic_axes={**{name: {0: "batch", 1: "tokens"} for name in inputs},
                          kind.output: {0: "batch"}})
    _save_tokenizer(kind, work / onnx_cache.TOKENIZER_FILE)
    manifest = kind.manifest(inputs)
    fused = work / "fused.onnx"
    unfused_because = onnx_fusion.fuse(raw, fused, kind.model.config)
    if unfused_because is None:
        _optimise(fused, work / onnx_cache.MODEL_FILE)
        onnx_fusion.remove(fused)
        decided = _decide(kind, work, manifest)
        if decided.checked:  # its outputs matched: timed, and decided
            raw.unlink()
            return _with(decided, reason=f"{decided.reason}, fused")
        unfused_because = f"the fused graph failed its check: {decided.reason}"
        log.warning("%s; trying the graph unfused", unfused_because)
    _optimise(raw, work / onnx_cache.MODEL_FILE)
    raw.unlink()
    decided = _decide(kind, work, manifest)
    # In `status`: the export's process log goes nowhere once it has succeeded.
    return _with(decided, reason=f"{decided.reason}; not fused: {unfused_because}")


@contextlib.contextmanager
def _eager_attention(model: Any) -> Iterator[None]:
    """Trace attention as transformers' plain matmuls and softmax, not torch's SDPA, whose
    export wraps each layer in mask handling (IsNaN, Where: the graph had 60% more
    nodes): ONNX Runtime ran a lone MiniLM text 10-13% faster (5.14 against 5.70 ms and
    5.32 against 6.13, medians of five interleaved rounds in two runs, 2 threads; batches
    of 32 alike). The model is put back as it was, for the timing that follows."""
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    set_attention = getattr(model, "set_attn_implementation", None)
    switched = False
    if callable(set_attention) and before not in (None, "eager"):
        with contextlib.suppress(Exception):  # a model without it exports as it runs
            set_attention("eager")
            switched = True
    try:
        yield
    finally:
        if switched:
            set_attention(before)


def _optimise(raw: Path, out: Path) -> None:
    """ONNX Runtime's graph optimisations, done once and saved (portable level), with the
    weights in an external file so that sessions map them instead of copying them. The
    weights prepacked for this CPU's matrix kernels are saved there too: every session of
    every worker then maps one prepacked copy instead of making a private one (~45 MiB
    for MiniLM each)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(out)
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", f"{out.name}.data")
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    options.add_session_config_entry(
        "session.save_external_prepacked_constant_initializers", "1")
    options.log_severity_level = 3
    ort.InferenceSession(str(raw), options, providers=["CPUExecutionProvider"])


def _save_tokenizer(kind: _Kind, path: Path) -> None:
    """The fast tokenizer eager uses, with its padding and truncation set ("longest
    first", as eager's for pairs): the worker then needs only the `tokenizers` library,
    not transformers."""
    tokenizer = kind.tokenizer.backend_tokenizer
    tokenizer.enable_truncation(kind.max_length, strategy="longest_first")
    tokenizer.enable_padding(pad_id=kind.tokenizer.pad_token_id,
                             pad_token=kind.tokenizer.pad_token,
                             pad_type_id=kind.tokenizer.pad_token_type_id)
    tokenizer.save(str(path))


def _decide(kind: _Kind, work: Path, manifest: Manifest) -> Manifest:
    """Check the export against eager, then time both on the same threads: "auto" runs
    the export only when its outputs match and it is faster."""
    threads = torch.get_num_threads()
    candidate = kind.runner(work, manifest, threads)
    try:
        value = candidate.verify()
    except OutputsDiffer as exc:
        return _with(manifest, choice="eager", reason=str(exc))
    short = [item for item in kind.samples if _chars(item) < LONG_CHARS]
    eager_ms, onnx_ms = _best_ms(getattr(kind.eager, kind.method),
                                 getattr(candidate, kind.method), items=short)
    # One timing on a shared machine varies by tens of percent: only a clearly slower
    # export loses (the runtimes' usual order for encoders is the other way round).
    slower = onnx_ms > SLOWER * eager_ms
    check, fields = kind.checked(value)
    reason = (f"timing set in {onnx_ms:.1f} ms against eager PyTorch's {eager_ms:.1f} "
              f"({threads} threads), {check}")
    return _with(manifest, choice="eager" if slower else "onnx", reason=reason, **fields,
                 eager_ms=round(eager_ms, 2), onnx_ms=round(onnx_ms, 2))


def _best_ms(*runs: Any, items: list[Any]) -> list[float]:
    """Each runtime's best of a few rounds of a batch and single inputs of everyday
    lengths. The rounds take turns, so that a busy spell of the machine (other work, a
    test suite) slows both rather than whichever ran through it: the choice is cached."""
    for run in runs:
        run(items)  # warm
    best = [float("inf")] * len(runs)
    for _ in range(TIMING_ROUNDS):
        for index, run in enumerate(runs):
            started = time.perf_counter()
            run(items)
            for item in items[:4]:
                run([item])
            best[index] = min(best[index], time.perf_counter() - started)
    return [seconds * 1000 for seconds in best]


def _chars(item: str | tuple[str, str]) -> int:
    return len(item) if isinstance(item, str) else sum(len(text) for text in item)


def _with(manifest: Manifest, **changes: Any) -> Manifest:
    return msgspec.structs.replace(manifest, **changes)


def export_from_payload(payload: bytes) -> bytes:
    """[spec, model dir, entry dir] as msgpack (onnx_cache.export_payload): the
    manifest as JSON."""
    raw = msgspec.msgpack.decode(payload)
    spec = msgspec.convert(raw[0], ModelSpec)
    return msgspec.json.encode(export_entry(spec, Path(raw[1]), Path(raw[2])))


def main() -> None:
    """The payload on stdin; the manifest on stdout."""
    import sys

    sys.stdout.buffer.write(export_from_payload(sys.stdin.buffer.read()))


if __name__ == "__main__":
    main()
