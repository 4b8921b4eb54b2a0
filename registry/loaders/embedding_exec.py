"""The built-in text_embedding loader: ONNX Runtime or eager PyTorch, as the model's
`execution` says ("auto", "onnx", "eager"). Free of torch until eager PyTorch or an
export is needed, so a worker serving a cached export never imports torch.

"auto" runs the cached export when, at export, its vectors matched eager PyTorch's on
the reference texts and it was faster; "onnx" runs it whenever its vectors match (and
fails the load otherwise); "eager" never exports. Every load of an export checks it
against eager's reference vectors again before it serves.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from modelpool.registry.loaders import onnx_cache, onnx_embedding
from modelpool.registry.spec import ModelSpec

log = logging.getLogger("modelpool.onnx")


def load(spec: ModelSpec, model_dir: Path | None) -> Any:
    if model_dir is None:  # as loaders.common.require_dir, which would import torch
        raise ValueError(f"model {spec.key!r} has no files: give it a path, package or repo")
    reason = _onnx_unsupported(spec)
    if reason is not None and spec.execution == "onnx":
        raise ValueError(f"model {spec.key!r}: execution = \"onnx\" impossible: {reason}")
    if reason is None:
        try:
            model = _load_onnx(spec, model_dir)
        except Exception as exc:
            if spec.execution == "onnx":
                raise
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("model %r: not running ONNX (%s)", spec.key, reason)
        else:
            if not isinstance(model, str):
                return model
            reason = model
    from modelpool.registry.loaders import sentence_embedding

    eager = sentence_embedding.load(spec, model_dir)
    eager.execution_reason = reason
    return eager


def _load_onnx(spec: ModelSpec, model_dir: Path) -> Any:
    """The verified export, or why eager runs instead."""
    entry = onnx_cache.entry_dir(spec, model_dir)
    manifest = onnx_cache.read_manifest(entry)
    if manifest is None:
        from modelpool.registry.loaders import onnx_export

        manifest = onnx_export.export_entry(spec, model_dir, entry)
    if manifest.choice == "eager" and spec.execution == "auto":
        return manifest.reason
    if not manifest.inputs:  # execution = "onnx", but there is no export
        raise RuntimeError(manifest.reason)
    return onnx_embedding.open_entry(entry, manifest, threads=0)


def _onnx_unsupported(spec: ModelSpec) -> str | None:
    if spec.execution == "eager":
        return "execution = \"eager\""
    if spec.device not in ("auto", "cpu"):
        return f"device {spec.device}: ONNX runs on the CPU here"
    if spec.weights_holder == "on":
        return "weights_holder = \"on\" shares torch tensors"
    if spec.options.get("dtype", "float32") != "float32":
        return f"dtype {spec.options['dtype']}: the export is float32"
    return None
