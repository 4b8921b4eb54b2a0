"""Are a model's files there? Cheap checks the supervisor may make (a few stat calls, no
hub client, no network): a path, an installed package, or a hub repo in the Hugging Face
cache laid out as huggingface_hub writes it:

    <cache>/models--org--name/refs/<branch>          the commit the branch points at
    <cache>/models--org--name/snapshots/<commit>/f   -> ../../blobs/<sha256 or git sha1>
    <cache>/models--org--name/blobs/<hash>[.incomplete]
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from modelpool.registry.spec import ModelSpec

COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Missing:
    message: str  # names the path, the package, or the `modelpool pull` to run
    downloadable: bool = False  # a hub repo not in the cache: `pull` (or a load online) fetches it


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps its cache, by the same variables it reads."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def repo_cache_dir(repo: str, cache: Path | None = None) -> Path:
    return (cache or hub_cache_dir()) / ("models--" + repo.replace("/", "--"))


def cached_snapshot(repo: str, revision: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory of repo@revision in the cache, or None if it is not there."""
    base = repo_cache_dir(repo, cache)
    commit = revision if COMMIT.fullmatch(revision) else None
    if commit is None:
        try:
            commit = (base / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = base / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def local_dir(spec: ModelSpec) -> Path | None:
    """Where the model's files are on this machine now (a hub model: its snapshot in the
    hub cache, as its worker will find it), without a hub call; None if not here."""
    base: Path | None = None
    if spec.path:
        base = Path(spec.path).expanduser()
    elif spec.package:
        found = importlib.util.find_spec(spec.package)
        if found and found.origin:
            base = Path(found.origin).parent
    elif spec.repo:
        base = cached_snapshot(spec.repo, spec.revision)
    if base is None:
        return None
    return base / spec.subdir if spec.subdir else base


def pull_hint(spec: ModelSpec) -> str:
    revision = f" --revision {spec.revision}" if spec.revision != "main" else ""
    return f"run `modelpool pull {spec.key}{revision}`"


def missing_files(spec: ModelSpec, cache: Path | None = None) -> Missing | None:
    """What is missing for the model to load, or None when its files are in place (or a
    custom loader needs none)."""
    if spec.path:
        base = Path(spec.path).expanduser()
        if not (base / spec.subdir).is_dir():
            return Missing(f"model {spec.key!r}: path {base / spec.subdir} does not exist")
    elif spec.package:
        if importlib.util.find_spec(spec.package) is None:
            return Missing(f"model {spec.key!r}: package {spec.package!r} is not installed "
                           f"(pip install it)")
    elif spec.repo and cached_snapshot(spec.repo, spec.revision, cache) is None:
        offline = " and HF_HUB_OFFLINE is set" if hub_offline() else ""
        return Missing(f"model {spec.key!r}: {spec.repo}@{spec.revision} is not in the "
                       f"Hugging Face cache ({hub_cache_dir()}){offline}: {pull_hint(spec)}",
                       downloadable=True)
    return None


def download_progress_mb(repo: str, cache: Path | None = None) -> float:
    """MiB of this repo's blobs in the cache, partial downloads included: what a load or
    a pull that is fetching it has written so far."""
    blobs = repo_cache_dir(repo, cache) / "blobs"
    try:
        return sum(entry.stat().st_size for entry in os.scandir(blobs)) / 2**20
    except OSError:
        return 0.0


def partial_downloads(repo: str, cache: Path | None = None) -> bool:
    """Is a download of this repo under way (or interrupted): an `.incomplete` blob."""
    try:
        return any(e.name.endswith(".incomplete")
                   for e in os.scandir(repo_cache_dir(repo, cache) / "blobs"))
    except OSError:
        return False
