"""Are a model's files intact? Checked in the worker before a load and by
`modelpool verify`; `modelpool pull --repair` replaces what fails.

The Hugging Face cache names every blob by its hash: the sha256 of the content for LFS
files (weights), the git blob sha1 for the small ones. A snapshot's files are symlinks
to those blobs, so each file can be checked against its own name. Hashing gigabytes
takes seconds, so a blob that passed is remembered with its size and mtime (in
`modelpool-verified.json` beside the repo's blobs) and not hashed again until either
changes. A safetensors file (in any directory) is also checked for truncation: its
header says how many bytes of tensors follow, which costs one small read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HASHED = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
VERIFIED_FILE = "modelpool-verified.json"
CHUNK = 1 << 20


@dataclass(frozen=True)
class Corrupt:
    path: Path  # the file as the model directory names it
    why: str


@dataclass(frozen=True)
class Report:
    files: int
    checked: int  # files whose hash was computed now
    remembered: int  # files that passed before, unchanged since
    corrupt: list[Corrupt]


def blob_digest(path: Path, name_length: int) -> str:
    """The hash a cache blob is named by: sha256 (64 hex) or the git blob sha1 (40)."""
    if name_length == 64:
        return file_hash(path, hashlib.sha256())
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(b"blob %d\0" % path.stat().st_size)
    return file_hash(path, digest)


def file_hash(path: Path, digest: Any, stop: threading.Event | None = None) -> str:
    """The file's content through the hash, a megabyte at a time; once `stop` is set
    (the daemon is stopping), InterruptedError instead."""
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            if stop is not None and stop.is_set():
                raise InterruptedError(f"stopped while hashing {path}")
            digest.update(chunk)
    return digest.hexdigest()


def safetensors_problem(path: Path) -> str | None:
    """Why this safetensors file cannot be whole (truncated, not safetensors), or None."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"{size} bytes: too short for a safetensors header"
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                return f"header of {header_len} bytes in a file of {size}: truncated"
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError) as exc:
        return f"unreadable safetensors header ({exc})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return f"{size} bytes where its header needs {expected}: truncated"
    return None


def verify_dir(model_dir: Path) -> Report:
    """Every file of a model directory: hub blobs against their hash names (remembered
    once passed), safetensors files for truncation."""
    remembered = _remembered(model_dir)
    passed: dict[str, list[int]] = {}
    corrupt: list[Corrupt] = []
    checked = reused = 0
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    for path in files:
        blob = _blob_of(path)
        if blob is not None:
            stat = blob.stat()
            mark = [stat.st_size, stat.st_mtime_ns]
            if remembered.get(blob.name) == mark:
                reused += 1
                passed[blob.name] = mark
                continue
            checked += 1
            digest = blob_digest(blob, len(blob.name))
            if digest != blob.name:
                corrupt.append(Corrupt(path, f"its content hashes to {digest[:12]}..., "
                                             f"not {blob.name[:12]}... as the hub says"))
                continue
        if path.suffix == ".safetensors" and (why := safetensors_problem(path)):
            corrupt.append(Corrupt(path, why))
            continue
        if blob is not None:
            passed[blob.name] = mark
    _remember(model_dir, {**remembered, **passed}, {c.path for c in corrupt})
    return Report(len(files), checked, reused, corrupt)


def blobs_of(corrupt: list[Corrupt]) -> list[Path]:
    """The cache blobs behind corrupt snapshot files (what --repair deletes)."""
    return [blob for c in corrupt if (blob := _blob_of(c.path)) is not None]


def _blob_of(path: Path) -> Path | None:
    """The cache blob a snapshot file links to, when it is named by a hash."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name != "blobs" or not HASHED.fullmatch(target.name):
        return None
    return target


def _verified_file(model_dir: Path) -> Path | None:
    """snapshots/<commit>/ -> the repo's directory, where the record is kept."""
    repo = model_dir.resolve().parent.parent
    return repo / VERIFIED_FILE if (repo / "blobs").is_dir() else None


def _remembered(model_dir: Path) -> dict[str, list[int]]:
    record = _verified_file(model_dir)
    try:
        data = json.loads(record.read_text()) if record else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(model_dir: Path, passed: dict[str, list[int]], corrupt: set[Path]) -> None:
    record = _verified_file(model_dir)
    if record is None:
        return
    bad = {b.name for b in blobs_of([Corrupt(p, "") for p in corrupt])}
    data = {name: mark for name, mark in passed.items() if name not in bad}
    temporary = record.with_name(f".{record.name}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps(data))
        temporary.replace(record)
    except OSError:  # a read-only cache: verified again next time
        temporary.unlink(missing_ok=True)
