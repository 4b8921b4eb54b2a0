"""Turn a ModelSpec into a loaded model object that implements its capability's interface.

Runs in the worker process only (imports torch through the loaders it picks).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelpool.registry.download import resolve_model_dir
from modelpool.registry.spec import ModelSpec

Loader = Callable[[ModelSpec, Path | None], Any]

DEFAULT_LOADERS: dict[str, str] = {
    "text_embedding": "modelpool.registry.loaders.sentence_embedding:load",
    "text_to_text": "modelpool.registry.loaders.causal_lm:load",
    "image_embedding": "modelpool.registry.loaders.clip:load",
    "vision": "modelpool.registry.loaders.vision_lm:load",
    "text_to_image": "modelpool.registry.loaders.diffusion:load",
}


def resolve_loader(spec: ModelSpec) -> Loader:
    """The spec's own loader ("package.module:function"), else its capability's default."""
    target = spec.loader or DEFAULT_LOADERS.get(spec.capability)
    if target is None:
        raise LookupError(f"no loader for capability {spec.capability!r} yet")
    module_name, sep, attr = target.partition(":")
    if not sep or not attr:
        raise ValueError(f"loader {target!r} must look like 'package.module:function'")
    loader = getattr(importlib.import_module(module_name), attr, None)
    if not callable(loader):
        raise LookupError(f"loader {target!r}: {attr!r} is not a function of {module_name}")
    return loader


def load_model(spec: ModelSpec) -> Any:
    return load_model_with_dir(spec)[0]


def load_model_with_dir(spec: ModelSpec) -> tuple[Any, Path | None]:
    loader = resolve_loader(spec)
    model_dir = resolve_model_dir(spec)
    return loader(spec, model_dir), model_dir


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_size_mb(model_dir: Path | None) -> float | None:
    """Size of the weight files: what every worker maps and so is charged once."""
    if model_dir is None:
        return None
    files = [p for p in model_dir.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20 if files else None
