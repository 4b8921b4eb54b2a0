"""Whether a decoder-only model can be batched continuously (batched_decode.py), and how
many sequences at once by default: as many full-context KV caches as a share of the
memory available at load holds, up to a cap."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

DEFAULT_MAX_SEQUENCES = 16  # the default cap; fewer when their KV caches would not fit
KV_MEMORY_FRACTION = 0.25  # of the memory available at load, for full-context KV caches
# Kept prefixes (prefix_cache.py): this share of the memory available at load, up to a cap
PREFIX_CACHE_FRACTION = 0.05
PREFIX_CACHE_MAX_BYTES = 512 << 20


def unsupported(model: Any) -> str | None:
    """Why this model cannot be batched this way, or None if it can."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    try:
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # a config the cache cannot read: do not guess
        return f"its cache layout is unknown ({type(exc).__name__})"
    if any(type(layer) is not DynamicLayer for layer in layers):
        return "its cache is not plain full attention (sliding window, hybrid, recurrent)"
    inner = getattr(model, "model", None)
    if hasattr(model, "get_rope_index") or hasattr(inner, "get_rope_index"):
        return "its positions are multimodal (mrope)"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids"
    return None


def default_max_sequences(model: Any) -> int:
    """DEFAULT_MAX_SEQUENCES, or fewer if that many full-context KV caches would take
    more than KV_MEMORY_FRACTION of the memory available now."""
    config = model.config.get_text_config(decoder=True)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layers = int(config.num_hidden_layers)
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    per_sequence = 2 * layers * kv_heads * head_dim * context * model.dtype.itemsize
    return max(1, min(DEFAULT_MAX_SEQUENCES,
                      int(KV_MEMORY_FRACTION * _available_bytes(model.device) // per_sequence)))


def default_prefix_cache_bytes(model: Any) -> int:
    """The prefix cache's budget unless configured (prefix_cache_mb)."""
    return min(PREFIX_CACHE_MAX_BYTES, int(PREFIX_CACHE_FRACTION * _available_bytes(model.device)))


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)
