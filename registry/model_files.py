"""A model's files on this machine: where they are, what its generation config
recommends, downloading a hub model into the Hugging Face cache, and removing cached
files that fail their integrity check."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.fields import RequestDefaults
from modelpool.registry.spec import ModelSpec

log = logging.getLogger("modelpool.registry")
# What vLLM takes of a generation_config.json as the defaults of a request: its name
# there, and the request's field it stands for
RECOMMENDABLE = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}


def model_dir(spec: ModelSpec) -> Path:
    """Where the spec's files are now (a hub repo: its cached snapshot)."""
    from modelpool.registry.sources import cached_snapshot, missing_files

    if missing := missing_files(spec):
        raise PoolError(ErrorCode.MODEL_LOAD_FAILED, missing.message)
    if spec.repo:
        found = cached_snapshot(spec.repo, spec.revision)
        assert found is not None
        return found / spec.subdir
    from modelpool.registry.download import resolve_model_dir

    resolved = resolve_model_dir(spec)
    if resolved is None:
        raise PoolError(ErrorCode.BAD_REQUEST, f"model {spec.key!r} has a custom loader "
                        f"and no files to check")
    return resolved


def recommended_sampling(spec: ModelSpec) -> dict[str, Any]:
    """What the model's generation_config.json sets of temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens (as max_tokens), by the request field each
    stands for (as vLLM reads it: the fields present; `do_sample` and the rest are not
    sampling this daemon does). Nothing when its files are not here (yet) or the file is
    absent; a value out of range is left out, with a warning."""
    from modelpool.registry.download import ModelSourceError

    try:
        config = json.loads((model_dir(spec) / "generation_config.json").read_bytes())
    except (OSError, ValueError, ModelSourceError, PoolError):  # no files, or no such file
        return {}
    recommended = {}
    for name, field in RECOMMENDABLE.items():
        value = config.get(name) if isinstance(config, dict) else None
        if value is None:
            continue
        try:  # checked as the [defaults] value it stands in for
            recommended[field] = getattr(msgspec.convert({field: value}, RequestDefaults),
                                         field)
        except msgspec.ValidationError as exc:
            log.warning("model %s: its generation_config.json's %s is not used: %s",
                        spec.key, name, exc)
    return recommended


def delete_corrupt(spec: ModelSpec) -> list[tuple[Path, str]]:
    """Delete a hub model's cached files that fail their check (blob and link), so
    that a download replaces them; what was removed, and why."""
    from modelpool.registry.integrity import blobs_of, verify_dir
    from modelpool.registry.sources import cached_snapshot

    snapshot = cached_snapshot(spec.repo or "", spec.revision)
    if snapshot is None:
        return []
    corrupt = verify_dir(snapshot).corrupt
    for blob in blobs_of(corrupt):
        blob.unlink(missing_ok=True)
    for bad in corrupt:
        bad.path.unlink(missing_ok=True)  # the snapshot's link, or a plain file
    return [(bad.path, bad.why) for bad in corrupt]


def download(spec: ModelSpec) -> Path:
    """huggingface_hub's snapshot download: resumable, its progress bars on a terminal."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    from modelpool.registry.download import hub_patterns

    if not sys.stderr.isatty():
        disable_progress_bars()
    try:
        return Path(snapshot_download(repo_id=spec.repo or "", revision=spec.revision,
                                      allow_patterns=hub_patterns(spec)))
    except Exception as exc:  # the hub client raises many types; the cause is what matters
        raise PoolError(ErrorCode.MODEL_LOAD_FAILED, f"pulling {spec.repo}@{spec.revision} "
                        f"failed: {type(exc).__name__}: {exc}") from None
