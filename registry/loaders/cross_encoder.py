"""Cross-encoders for rerank with transformers: each (query, document) pair goes through
a sequence classifier together (BERT-style: [CLS] query [SEP] document [SEP]) and comes
out as one relevance logit, turned into a score as sentence-transformers' CrossEncoder
does (a sigmoid for one-logit models)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from modelpool.registry.loaders.common import (
    configured_tokens,
    own_tokens,
    place,
    pretrained_kwargs,
    require_dir,
)
from modelpool.registry.spec import ModelSpec

ACTIVATIONS = ("sigmoid", "none")  # "none": the raw logit


class CrossEncoder:
    def __init__(self, tokenizer: Any, model: Any, max_length: int, activation: str) -> None:
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.max_length = max_length
        self.activation = activation
        self.execution_reason = ""  # why not ONNX (registry/loaders/encoder_exec.py)
        self.onnx_export: dict[str, str] | None = None  # the export still to make

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "max_length": self.max_length, "activation": self.activation,
            "execution": "eager", "execution_reason": self.execution_reason}
        if self.onnx_export is not None:
            info["onnx_export"] = self.onnx_export
        return info

    @torch.inference_mode()
    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        queries, documents = [q for q, _ in pairs], [d for _, d in pairs]
        # Pairs longer than max_length lose tokens from the longer of the two first.
        batch = self.tokenizer(queries, documents, padding=True, truncation=True,
                               max_length=self.max_length,
                               return_tensors="pt").to(self.model.device)
        logits = self.model(**batch).logits[:, 0]
        scores = torch.sigmoid(logits) if self.activation == "sigmoid" else logits
        return scores.float().cpu().numpy()


def load(spec: ModelSpec, model_dir: Path | None) -> CrossEncoder:
    model_dir = require_dir(spec, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    model = place(spec, AutoModelForSequenceClassification.from_pretrained(
        model_dir, **pretrained_kwargs(spec)))
    labels = int(model.config.num_labels)
    if labels != 1:
        raise ValueError(f"model {spec.key!r} has {labels} output labels; a reranker has "
                         "one relevance logit")
    activation = spec.options.get("activation", "sigmoid")
    if activation not in ACTIVATIONS:
        raise ValueError(f"model {spec.key!r}: activation {activation!r} not in {ACTIVATIONS}")
    max_length = configured_tokens(spec, "max_length", own_tokens(model.config, 512))
    return CrossEncoder(tokenizer, model, max_length, activation)
