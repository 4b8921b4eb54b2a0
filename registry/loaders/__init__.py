"""Turn a ModelSpec into a loaded model object that implements its capability's interface.

Runs in the worker process only (imports torch through the loaders it picks).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from registry.download import resolve_model_dir
from registry.spec import ModelSpec

Loader = Callable[[ModelSpec, Path | None], Any]

DEFAULT_LOADERS: dict[str, str] = {
    "text_embedding": "registry.loaders.sentence_embedding:load",
    "text_to_text": "registry.loaders.causal_lm:load",
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
    loader = resolve_loader(spec)
    return loader(spec, resolve_model_dir(spec))
