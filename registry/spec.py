"""What a model is and where it comes from: the ModelSpec, the catalogue, and lookup.

This module must stay free of torch and transformers: the supervisor imports it.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from typing import Annotated, Any, Literal

import msgspec

from modelpool.protocol.fields import Capability
from modelpool.protocol.kinds import CAPABILITIES


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    key: str
    capability: Capability
    aliases: list[str] = []
    # Source: exactly one of path, package, repo, unless a custom loader needs none.
    path: str | None = None  # a local directory
    package: str | None = None  # an installed Python package that ships the files
    repo: str | None = None  # a hub repo, fetched with huggingface_hub into its cache
    revision: str = "main"
    subdir: str = ""  # inside the package or repo
    loader: str | None = None  # "package.module:function"; default: by capability
    options: dict[str, Any] = {}  # handed to the loader (e.g. dtype, max_seq_length)
    allow_pickle: bool = False  # permit .bin/.pt weights (runs pickle: trusted files only)
    trust_remote_code: bool = False
    device: str = "auto"  # "cpu", "cuda", "cuda:N"; "auto": the first GPU if any, else cpu
    default: bool = False  # the model used when a request names none for its capability
    # Weights held once by a holder process that workers map: "auto" on GPUs (CUDA IPC);
    # "on" also on the CPU (for weights converted at load); "off": CPU workers map the
    # weight files, GPU workers each load a copy.
    weights_holder: Literal["auto", "on", "off"] = "auto"
    # How a text_embedding or rerank model with the built-in loader runs on the CPU:
    # "onnx" (exported once, cached, run by ONNX Runtime), "eager" (PyTorch), or "auto":
    # ONNX when its outputs match eager PyTorch's and it is faster (registry/loaders/onnx_*).
    execution: Literal["auto", "eager", "onnx"] = "auto"
    # Memory estimates in MiB, replaced by measurements once a worker has loaded.
    weights_mb: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    per_worker_mb: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # Per-model overrides of [pool] knobs; None: the pool's value.
    max_workers: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_batch: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_queue: Annotated[int, msgspec.Meta(ge=1)] | None = None
    threads: Annotated[int, msgspec.Meta(ge=1)] | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    stall_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # Streams one text_to_text or vision worker decodes together (continuous batching);
    # None: sized from the model and memory (at most 16); 1: one at a time.
    max_active_sequences: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # text_to_text, vision: the sampling its generation_config.json recommends (temperature,
    # top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) is what a
    # request that leaves them unset gets, before [defaults].
    generation_config: bool = True

    def __post_init__(self) -> None:
        if self.capability not in CAPABILITIES:
            raise ValueError(f"model {self.key!r}: capability {self.capability!r} is not one "
                             f"of {sorted(CAPABILITIES)}")
        sources = [s for s in (self.path, self.package, self.repo) if s]
        if len(sources) > 1:
            raise ValueError(f"model {self.key!r}: give only one of path, package, repo")
        if not sources and not self.loader:
            raise ValueError(f"model {self.key!r}: needs path, package or repo (or a loader)")

    @property
    def batched(self) -> bool:
        return CAPABILITIES[self.capability].batched

    @property
    def streaming(self) -> bool:
        return CAPABILITIES[self.capability].streaming

    @property
    def source(self) -> str:
        if self.path:
            return f"path:{self.path}"
        if self.package:
            return f"package:{self.package}/{self.subdir}".rstrip("/")
        if self.repo:
            return f"hub:{self.repo}@{self.revision}"
        return f"loader:{self.loader}"


class _Catalog(msgspec.Struct, forbid_unknown_fields=True):
    models: list[ModelSpec]


def load_catalog() -> list[ModelSpec]:
    """The built-in models, from registry/catalog.toml."""
    data = importlib.resources.files("modelpool.registry").joinpath("catalog.toml").read_bytes()
    return msgspec.toml.decode(data, type=_Catalog).models


class Registry:
    """The known models: the catalogue, overridden and extended by the config."""

    def __init__(self, specs: list[ModelSpec]) -> None:
        self.update(specs)

    def update(self, specs: list[ModelSpec]) -> None:
        """Know these models instead (a reload): in place, so that whatever holds this
        registry resolves names against the new set."""
        self.specs: dict[str, ModelSpec] = {}
        self._names: dict[str, str] = {}
        for spec in specs:
            if spec.key in self.specs:
                self._drop(self.specs[spec.key])
            self.specs[spec.key] = spec
            for name in [spec.key, *spec.aliases]:
                self._names[name.lower()] = spec.key
        self.defaults = self._pick_defaults()

    def _drop(self, spec: ModelSpec) -> None:
        for name in [spec.key, *spec.aliases]:
            self._names.pop(name.lower(), None)

    def _pick_defaults(self) -> dict[str, str]:
        defaults: dict[str, str] = {}
        for spec in self.specs.values():  # a later explicit default wins over an earlier one
            if spec.default or spec.capability not in defaults:
                defaults[spec.capability] = spec.key
        return defaults

    def resolve(self, name: str) -> ModelSpec | None:
        key = self._names.get(name.lower())
        return self.specs[key] if key else None
