"""The built-in loader of encoder models, sentence embedders (text_embedding) and
cross-encoders (rerank): ONNX Runtime or eager PyTorch, as the model's `execution` says
("auto", "onnx", "eager"). Free of torch until eager PyTorch or an export is needed, so
a worker serving a cached export never imports torch.

"auto" runs the cached export when, at export, its outputs matched eager PyTorch's on
the reference inputs and it was faster. With no export cached yet, "auto" serves eager
PyTorch at once and says so in its info (`onnx_export`): the daemon makes the export in
the background and replaces the worker (supervisor/exports.py). "onnx" runs the export
whenever its outputs match (and fails the load otherwise); with none cached it exports at
load, except in a daemon's worker, which leaves the export to the daemon (ExportNotMade);
"eager" never exports. Every load of an export checks it against eager's reference
outputs again before it serves.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from modelpool.registry.loaders import local_config, onnx_cache, onnx_embedding, onnx_rerank
from modelpool.registry.loaders.onnx_cache import Manifest
from modelpool.registry.spec import ModelSpec

log = logging.getLogger("modelpool.onnx")
NOT_EXPORTED_YET = "no ONNX export yet: the daemon makes one in the background"
# Each capability's eager loader (a module of registry/loaders, which imports torch) and
# what runs its export.
EAGER = {"text_embedding": "sentence_embedding", "rerank": "cross_encoder"}
ONNX = {"text_embedding": onnx_embedding.OnnxEmbedder, "rerank": onnx_rerank.OnnxReranker}


def load(spec: ModelSpec, model_dir: Path | None) -> Any:
    if model_dir is None:  # as loaders.common.require_dir, which would import torch
        raise ValueError(f"model {spec.key!r} has no files: give it a path, package or repo")
    model = _load(spec, model_dir)
    if spec.capability == "text_embedding":
        model.matryoshka_dimensions = matryoshka_dimensions(spec, model_dir)
    return model


def matryoshka_dimensions(spec: ModelSpec, model_dir: Path) -> list[int] | None:
    """The sizes the model's vectors may be shortened to ([]: any), or None: from the
    option `matryoshka_dimensions` (a list, or true), else its config.json's
    `matryoshka_dimensions` or `is_matryoshka` (the keys vLLM reads)."""
    declared = spec.options.get("matryoshka_dimensions")
    if declared is None:
        config = local_config(model_dir) or {}
        declared = config.get("matryoshka_dimensions") or config.get("is_matryoshka")
    if declared is None or declared is False:
        return None
    if declared is True:
        return []
    if not (isinstance(declared, list) and declared
            and all(type(d) is int and d > 0 for d in declared)):
        raise ValueError(f"model {spec.key!r}: matryoshka_dimensions must be true or a "
                         f"list of sizes, not {declared!r}")
    return sorted(set(declared), reverse=True)


def _load(spec: ModelSpec, model_dir: Path) -> Any:
    reason = onnx_cache.unsupported(spec)
    if reason is not None and spec.execution == "onnx":
        raise ValueError(f"model {spec.key!r}: execution = \"onnx\" impossible: {reason}")
    missing: Path | None = None  # the export to make, when there is none yet
    if reason is None:
        try:
            model = _load_onnx(spec, model_dir)
        except Exception as exc:
            if spec.execution == "onnx":
                raise
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("model %r: not running ONNX (%s)", spec.key, reason)
        else:
            if isinstance(model, _Missing):
                reason, missing = NOT_EXPORTED_YET, model.entry
            elif isinstance(model, str):
                reason = model
            else:
                return model
    eager = importlib.import_module(f"modelpool.registry.loaders.{EAGER[spec.capability]}"
                                    ).load(spec, model_dir)
    eager.execution_reason = reason
    if missing is not None:
        eager.onnx_export = {"entry": str(missing), "model_dir": str(model_dir)}
    return eager


class _Missing(NamedTuple):
    entry: Path


def _load_onnx(spec: ModelSpec, model_dir: Path) -> Any:
    """The verified export, the entry of one still to make, or why eager runs instead."""
    entry = onnx_cache.entry_dir(spec, model_dir)
    manifest = onnx_cache.read_manifest(entry)
    if manifest is None and spec.execution == "auto":
        return _Missing(entry)  # the first request need not wait for an export
    if manifest is None and os.environ.get(onnx_cache.EXPORTS_BY_DAEMON_ENV):
        raise onnx_cache.ExportNotMade(entry, model_dir)  # "onnx": no eager meanwhile
    if manifest is None:
        manifest = export_in_child(spec, model_dir, entry)
    if manifest.choice == "eager" and spec.execution == "auto":
        return manifest.reason
    if not manifest.inputs:  # execution = "onnx", but there is no export
        raise RuntimeError(manifest.reason)
    return ONNX[spec.capability].open_checked(entry, manifest, threads=0)


def export_in_child(spec: ModelSpec, model_dir: Path, entry: Path) -> Manifest:
    """The export, in a process of its own (registry/loaders/onnx_export.py)."""
    argv, payload = onnx_cache.export_command(spec, model_dir, entry)
    done = subprocess.run(argv, input=payload, capture_output=True,
                          timeout=onnx_cache.EXPORT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(onnx_cache.export_failure(done.returncode, done.stderr))
    return msgspec.json.decode(done.stdout, type=Manifest)
