"""Helpers shared by the transformers-based loaders."""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Any

import torch
import tqdm

from modelpool.registry.spec import ModelSpec

# Every tqdm bar, even a disabled one (transformers and diffusers make them while
# loading), would otherwise create a named multiprocessing semaphore registered with the
# daemon's resource tracker. A worker leaves with os._exit, so it stays registered and
# the tracker warned "leaked semaphore objects" at every stop. A worker's bars share no
# terminal with another process: a thread lock is all they need. Set here, where every
# torch-based loader passes, whether the forkserver imported torch or the worker did.
tqdm.tqdm.set_lock(threading.RLock())

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def require_dir(spec: ModelSpec, model_dir: Path | None) -> Path:
    if model_dir is None:
        raise ValueError(f"model {spec.key!r} has no files: give it a path, package or repo")
    return model_dir


def device_of(spec: ModelSpec) -> torch.device:
    """Where the model runs; the supervisor resolved "auto" before the worker got the spec.
    CUDA is first touched here, in the worker, never in the supervisor or the forkserver."""
    return torch.device("cpu" if spec.device == "auto" else spec.device)


def place(spec: ModelSpec, model: Any) -> Any:
    device = device_of(spec)
    return model if device.type == "cpu" else model.to(device)


def own_tokens(config: Any, default: int) -> int:
    """The tokens the model's config says a sequence may hold (default: it says none)."""
    return int(getattr(config, "max_position_embeddings", 0) or default)


def configured_tokens(spec: ModelSpec, option: str, model_limit: int) -> int:
    """The tokens a sequence may hold: the model's own limit, or the lower one the
    model's `option` sets (a bound on each sequence's time and memory)."""
    value = spec.options.get(option, model_limit)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model {spec.key!r}: {option} must be a whole number of tokens, "
                         f"at least 1, not {value!r}")
    return min(value, model_limit)


def pretrained_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """from_pretrained arguments every loader honours: dtype, weight format, remote code."""
    dtype_name = spec.options.get("dtype", "float32")
    if dtype_name not in DTYPES:
        raise ValueError(f"model {spec.key!r}: dtype {dtype_name!r} not in {sorted(DTYPES)}")
    return {
        "dtype": DTYPES[dtype_name],
        # Pickle-based weights run arbitrary code on load: only when the entry opts in.
        "use_safetensors": not spec.allow_pickle,
        "trust_remote_code": spec.trust_remote_code,
        "local_files_only": True,
    }


def vocab_size(model: Any) -> int | None:
    """How many tokens the model's logits cover (None: it does not say)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    size = getattr(model.config.get_text_config(), "vocab_size", None)
    return size if isinstance(size, int) else None


def kv_cache_keyword(model: Any) -> str:
    """The keyword a causal LM's forward takes its KV cache by: `cache` where transformers
    has renamed it (5.x warns on `past_key_values`, and 5.40 drops it), else
    `past_key_values`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def last_logits_only(model: Any) -> dict[str, int]:
    """What asks a causal LM's forward for the last position's logits only (a prompt's
    all would be its tokens x the vocabulary), where its forward takes it."""
    takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if takes else {}


def kv_cache_of(output: Any) -> Any:
    """The KV cache a forward returned, under whichever name its transformers gives it."""
    return output["cache"] if "cache" in output else output["past_key_values"]
