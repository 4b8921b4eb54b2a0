"""Sentence embeddings with plain transformers, pooled and normalised as the model's
sentence-transformers files (modules.json, 1_Pooling/config.json) say."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from modelpool.registry.loaders.common import place, pretrained_kwargs, require_dir
from modelpool.registry.spec import ModelSpec

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")
_POOLING_FLAGS = {  # sentence-transformers' 1_Pooling/config.json names
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


class SentenceEmbedder:
    def __init__(self, tokenizer: Any, model: Any, pooling: str, normalize: bool,
                 max_seq_length: int, lowercase: bool) -> None:
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.pooling = pooling
        self.normalize = normalize
        self.max_seq_length = max_seq_length
        self.lowercase = lowercase
        self.dim = int(model.config.hidden_size)
        self.execution_reason = ""  # why not ONNX (registry/loaders/encoder_exec.py)
        self.onnx_export: dict[str, str] | None = None  # the export still to make:
        # its cache entry and the model's files (registry/loaders/encoder_exec.py)
        self.matryoshka_dimensions: list[int] | None = None  # set by encoder_exec.load

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "dim": self.dim, "max_seq_length": self.max_seq_length, "pooling": self.pooling,
            "execution": "eager", "execution_reason": self.execution_reason}
        if self.onnx_export is not None:
            info["onnx_export"] = self.onnx_export
        if self.matryoshka_dimensions is not None:
            info["matryoshka_dimensions"] = self.matryoshka_dimensions
        return info

    def set_threads(self, threads: int) -> None:
        """Intra-op threads of the next forward passes (the whole process's torch pool)."""
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_counted(texts)[0]

    @torch.inference_mode()
    def embed_counted(self, texts: Sequence[str]) -> tuple[np.ndarray, list[int]]:
        """The vectors, and the tokens each text was read as (usage figures)."""
        if self.lowercase:
            texts = [t.lower() for t in texts]
        batch = self.tokenizer(list(texts), padding=True, truncation=True,
                               max_length=self.max_seq_length,
                               return_tensors="pt").to(self.model.device)
        hidden = self.model(**batch).last_hidden_state
        pooled = pool(hidden, batch["attention_mask"], self.pooling)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().numpy(), batch["attention_mask"].sum(dim=1).tolist()


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1  # right padding: the last real token of each row
        return hidden[torch.arange(hidden.shape[0]), last]
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return summed / (counts.sqrt() if mode == "mean_sqrt_len" else counts)


def load(spec: ModelSpec, model_dir: Path | None) -> SentenceEmbedder:
    model_dir = require_dir(spec, model_dir)
    layout = _read_layout(model_dir)
    pooling = spec.options.get("pooling", layout["pooling"])
    if pooling not in POOLING_MODES:
        raise ValueError(f"model {spec.key!r}: pooling {pooling!r} not in {POOLING_MODES}")
    transformer_dir = model_dir / layout["transformer_path"]
    kwargs = pretrained_kwargs(spec)
    tokenizer = AutoTokenizer.from_pretrained(
        transformer_dir, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    model = place(spec, AutoModel.from_pretrained(transformer_dir, **kwargs))
    limit = int(getattr(model.config, "max_position_embeddings", 512))
    max_len = spec.options.get("max_seq_length", layout["max_seq_length"]) or limit
    return SentenceEmbedder(
        tokenizer, model, pooling,
        normalize=bool(spec.options.get("normalize", layout["normalize"])),
        max_seq_length=min(int(max_len), limit),
        lowercase=bool(layout["lowercase"]),
    )


def _read_layout(model_dir: Path) -> dict[str, Any]:
    """The sentence-transformers pipeline of a model dir; mean + normalise without one."""
    layout: dict[str, Any] = {"transformer_path": "", "pooling": "mean", "normalize": True,
                              "max_seq_length": None, "lowercase": False}
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return layout
    modules = json.loads(modules_file.read_text())
    layout["normalize"] = any(m["type"].endswith("Normalize") for m in modules)
    for module in modules:
        kind, path = module["type"], module.get("path", "")
        if kind.endswith("Transformer"):
            layout["transformer_path"] = path
            _read_st_config(model_dir / path / "sentence_bert_config.json", layout)
        elif kind.endswith("Pooling"):
            layout["pooling"] = _pooling_mode(json.loads((model_dir / path / "config.json")
                                                         .read_text()))
        elif not kind.endswith("Normalize"):
            raise ValueError(f"unsupported sentence-transformers module {kind!r} "
                             f"(supported: Transformer, Pooling, Normalize)")
    return layout


def _read_st_config(path: Path, layout: dict[str, Any]) -> None:
    if path.exists():
        config = json.loads(path.read_text())
        layout["max_seq_length"] = config.get("max_seq_length")
        layout["lowercase"] = config.get("do_lower_case", False)


def _pooling_mode(config: dict[str, Any]) -> str:
    if "pooling_mode" in config:
        return {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(
            config["pooling_mode"], config["pooling_mode"])
    enabled = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    modes = [mode for mode, flag in _POOLING_FLAGS.items() if flag in enabled]
    if len(enabled) != 1 or len(modes) != 1:
        # Weighted mean, or several modes concatenated: refusing beats wrong vectors.
        raise ValueError(f"unsupported sentence-transformers pooling {enabled}")
    return modes[0]
