"""Turn a ModelSpec into a loaded model object that implements its capability's interface.

Runs in the worker process only (imports torch through the loaders it picks).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool.registry.download import check_intact, resolve_model_dir
from modelpool.registry.sources import local_dir
from modelpool.registry.spec import ModelSpec

Loader = Callable[[ModelSpec, Path | None], Any]


@dataclass(frozen=True)
class CapabilityLoader:
    loader: str  # "package.module:function", the capability's default loader
    preload: tuple[str, ...] = ()  # what else its models import, for the forkserver
    options: tuple[str, ...] = ()  # the `options` keys it reads besides COMMON_OPTIONS


COMMON_OPTIONS = ("dtype",)  # read by every built-in loader (common.pretrained_kwargs)

# The registry's column of the request-kind table (protocol/kinds.py): how each
# capability's models are loaded by default.
LOADERS: dict[str, CapabilityLoader] = {
    # Encoders: ONNX or eager (encoder_exec); the eager half is preloaded with torch,
    # when torch is.
    "text_embedding": CapabilityLoader(
        "modelpool.registry.loaders.encoder_exec:load",
        preload=("modelpool.registry.loaders.sentence_embedding",),
        options=("pooling", "max_seq_length", "normalize", "matryoshka_dimensions")),
    "text_to_text": CapabilityLoader("modelpool.registry.loaders.causal_lm:load",
                                     options=("context", "tool_call_format",
                                              "reasoning_format", "prefix_cache_mb",
                                              "structured_in_reasoning")),
    "image_embedding": CapabilityLoader("modelpool.registry.loaders.clip:load",
                                        options=("text_padding",)),
    "vision": CapabilityLoader("modelpool.registry.loaders.vision_lm:load",
                               options=("context", "reasoning_format",
                                        "structured_in_reasoning")),
    "text_to_image": CapabilityLoader("modelpool.registry.loaders.diffusion:load",
                                      preload=("diffusers",),
                                      options=("max_size", "preview_size")),
    "rerank": CapabilityLoader("modelpool.registry.loaders.encoder_exec:load",
                               preload=("modelpool.registry.loaders.cross_encoder",),
                               options=("activation", "max_length")),
}


def unknown_options(spec: ModelSpec) -> tuple[list[str], list[str]]:
    """(options the built-in loader would ignore, the ones it takes); nothing for a
    custom loader, whose options only it knows."""
    default = LOADERS.get(spec.capability)
    if spec.loader or default is None:
        return [], []
    known = sorted({*COMMON_OPTIONS, *default.options})
    return sorted(set(spec.options) - set(known)), known


def resolve_loader(spec: ModelSpec) -> Loader:
    """The spec's own loader ("package.module:function"), else its capability's default."""
    default = LOADERS.get(spec.capability)
    target = spec.loader or (default.loader if default else None)
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
    if model_dir is not None:
        check_intact(spec, model_dir)  # a corrupt file named, not a bare SafetensorError
    return loader(spec, model_dir), model_dir


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_size_mb(model_dir: Path | None) -> float | None:
    """Size of the weight files: what every worker maps and so is charged once."""
    if model_dir is None:
        return None
    files = [p for p in model_dir.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20 if files else None


def preload_modules(specs: list[ModelSpec]) -> list[str]:
    """Modules the configured models will need, for the forkserver to import once.

    Importing an architecture's module (or diffusers) costs ~1 s; doing it once in the
    forkserver means every forked worker starts with it already imported and shared.
    """
    modules: set[str] = set()
    for spec in specs:
        if spec.loader:  # its own module imports what it needs: torch only if it does
            modules.add(LOADER_MODULES_PRELOAD)
            continue
        default = LOADERS.get(spec.capability)
        local = local_dir(spec)
        if _runs_cached_onnx(spec, local):
            modules.update((default.loader.partition(":")[0], *ONNX_MODULES) if default
                           else ONNX_MODULES)  # and no torch for this one
            continue
        if local is None and not spec.loader and not _in_hub_cache(spec):
            continue  # its files are still to be fetched: its worker imports what it needs
        modules.add(TORCH_PRELOAD)
        if default is not None:
            modules.update((default.loader.partition(":")[0], *default.preload))
        if _may_run_onnx(spec):  # its export is still to be made: then it runs ONNX
            modules.update(ONNX_MODULES)
        config = local_config(local)
        model_type = config.get("model_type") if config else None
        if isinstance(model_type, str) and model_type.isidentifier():
            modules.add(f"transformers.models.{model_type}.modeling_{model_type}")
    return sorted(modules)


def custom_loader_modules(specs: list[ModelSpec]) -> list[str]:
    """The modules of the custom loaders (`loader = "package.module:function"`), which
    LOADER_MODULES_PRELOAD imports in the forkserver, read from LOADER_MODULES_ENV."""
    return sorted({spec.loader.partition(":")[0] for spec in specs if spec.loader})


# A custom loader's module is the operator's code: the forkserver imports it through this
# module, which keeps an error in it from killing the forkserver that every model's
# workers are forked from (its own workers then fail to load with that error).
LOADER_MODULES_PRELOAD = "modelpool.workers.preload_loaders"
LOADER_MODULES_ENV = "MODELPOOL_PRELOAD_LOADERS"  # comma-separated, set before the forkserver

# torch and transformers for the forkserver: ~2-3 s of a daemon's start, so only when a
# model that is on this machine needs them (a hub model not downloaded yet takes longer
# to fetch than its worker takes to import them).
TORCH_PRELOAD = "modelpool.workers.preload_torch"
ONNX_MODULES = ("modelpool.registry.loaders.onnx_embedding", "onnxruntime", "tokenizers")


def exports_to_make(specs: list[ModelSpec]) -> list[tuple[ModelSpec, Path, Path]]:
    """(spec, model files, cache entry) of each model on this machine that will run an
    ONNX export not made yet, for the daemon to make from its start, before the first
    request (supervisor/exports.py). Execution "auto" serves eager PyTorch meanwhile;
    "onnx" starts no worker until it is made."""
    from modelpool.registry.loaders import onnx_cache

    found = []
    for spec in specs:
        local = local_dir(spec)
        if local is None or not _may_run_onnx(spec) or not local.is_dir():
            continue
        try:
            entry = onnx_cache.entry_dir(spec, local)
        except OSError:  # a file it cannot read: its worker's load will say what
            continue
        if onnx_cache.read_manifest(entry) is None:
            found.append((spec, local, entry))
    return found


def _may_run_onnx(spec: ModelSpec) -> bool:
    """Whether its worker may run an ONNX export: not if forced to eager, on a GPU,
    sharing a weights holder's torch tensors or in a dtype other than float32."""
    from modelpool.registry.loaders import onnx_cache

    return (spec.capability in onnx_cache.OUTPUT_OPTIONS and not spec.loader
            and onnx_cache.unsupported(spec) is None)


def _runs_cached_onnx(spec: ModelSpec, local: Path | None) -> bool:
    from modelpool.registry.loaders import onnx_cache

    if not _may_run_onnx(spec) or local is None:
        return False
    return onnx_cache.cached_choice(spec, local) == "onnx"


def local_config(model_dir: Path | None) -> dict[str, Any] | None:
    """The model's config.json, or None when it has none that reads."""
    if model_dir is None:
        return None
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _in_hub_cache(spec: ModelSpec) -> bool:
    """Whether a hub model has files in the local hub cache (no hub call is made)."""
    if not spec.repo:
        return False
    from huggingface_hub import constants

    folder = "models--" + spec.repo.replace("/", "--")
    return (Path(constants.HF_HUB_CACHE) / folder).is_dir()
