"""What a model's files are, by content. Two nodes of a cluster whose configs name a
model by a local path or an installed package serve the same model exactly when its
files are the same: whatever the directory is called on each host, and not when one
host's copy (or package version) differs from another's under the same name.

The digest covers every file of the model's directory but hidden ones and Python's
`__pycache__` (tools' own records and bytecode, which differ from host to host for the
same model): each file's sha256, by its path inside the directory. Hashing gigabytes
takes seconds, so a file's digest is remembered with its size and mtime (in
`file-digests.json` in modelpool's cache directory) and not hashed again until either
changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from modelpool.registry.integrity import file_hash
from modelpool.registry.sources import local_dir
from modelpool.registry.spec import ModelSpec

REMEMBERED = "file-digests.json"
Remembered = dict[str, list[int | str]]  # resolved path -> [size, mtime_ns, sha256]


def cache_dir() -> Path:
    """$MODELPOOL_CACHE_DIR, else $XDG_CACHE_HOME/modelpool, else ~/.cache/modelpool."""
    explicit = os.environ.get("MODELPOOL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modelpool"


def content_digests(specs: Iterable[ModelSpec],
                    stop: threading.Event | None = None) -> dict[str, str]:
    """By key, the content digest of each model named by a path or a package whose files
    are on this machine (the others are known by their source alone). Once `stop` is
    set (the daemon is stopping), hashing ends within a megabyte, with what it has."""
    remembered = _read_remembered()
    found = {}
    for spec in specs:
        directory = local_dir(spec) if spec.path or spec.package else None
        if directory is None or not directory.is_dir():
            continue
        with contextlib.suppress(OSError):  # unreadable (or stopped): its load will say
            found[spec.key] = directory_digest(directory, remembered, stop)
    _write_remembered(remembered)
    return found


def directory_digest(directory: Path, remembered: Remembered,
                     stop: threading.Event | None = None) -> str:
    digest = hashlib.sha256()
    for path in model_files(directory):
        name = path.relative_to(directory).as_posix()
        digest.update(f"{name} {file_digest(path, remembered, stop)}\n".encode())
    return digest.hexdigest()


def model_files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file() and not any(
        part.startswith(".") or part == "__pycache__"
        for part in path.relative_to(directory).parts))


def file_digest(path: Path, remembered: Remembered,
                stop: threading.Event | None = None) -> str:
    resolved = str(path.resolve())
    stat = os.stat(resolved)
    mark: list[int | str] = [stat.st_size, stat.st_mtime_ns]
    known = remembered.get(resolved)
    if known is not None and known[:2] == mark:
        return str(known[2])
    sha256 = file_hash(Path(resolved), hashlib.sha256(), stop)
    remembered[resolved] = [*mark, sha256]
    return sha256


def _read_remembered() -> Remembered:
    try:
        data = json.loads((cache_dir() / REMEMBERED).read_text())
    except (OSError, ValueError):
        return {}
    return {path: mark for path, mark in data.items()
            if isinstance(mark, list) and len(mark) == 3} if isinstance(data, dict) else {}


def _write_remembered(remembered: Remembered) -> None:
    """Files gone since are forgotten. Written whole and renamed into place: daemons on
    one host may write at once, and the last one's record is as good as another's."""
    kept = {path: mark for path, mark in remembered.items() if os.path.exists(path)}
    target = cache_dir() / REMEMBERED
    with contextlib.suppress(OSError):  # unwritable: the files are hashed at each start
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{REMEMBERED}.{os.getpid()}")
        partial.write_text(json.dumps(kept))
        partial.replace(target)
