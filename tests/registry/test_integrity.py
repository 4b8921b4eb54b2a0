"""Integrity of a model's files: a fake Hugging Face cache (snapshots/<rev>/file ->
../../blobs/<hash>) with real hashes, corrupted; truncated safetensors; `verify` and
`pull --repair` through the CLI with the download replaced by a local copy."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from modelpool.registry import integrity, sources
from modelpool.registry.download import ModelSourceError, check_intact
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import cli_models
from modelpool.supervisor.cli import main

COMMIT = "c" * 40


def safetensors_bytes(n_floats: int) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats],
                               "data_offsets": [0, 4 * n_floats]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_file(cache: Path, repo: str, name: str, data: bytes) -> Path:
    base = sources.repo_cache_dir(repo, cache)
    blob_name = (hashlib.sha256(data).hexdigest() if name.endswith(".safetensors")
                 else git_sha1(data))
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    (base / "blobs" / blob_name).write_bytes(data)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(COMMIT)
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / name).symlink_to(f"../../blobs/{blob_name}")
    return snapshot / name


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("MODELPOOL_CONFIG", raising=False)
    add_file(tmp_path / "hub", "org/m", "config.json", b'{"model_type": "bert"}')
    add_file(tmp_path / "hub", "org/m", "model.safetensors", safetensors_bytes(1000))
    return tmp_path / "hub"


def test_intact_files_pass_and_are_hashed_once_per_size_and_mtime(cache: Path) -> None:
    snapshot = sources.cached_snapshot("org/m", "main", cache)
    assert snapshot is not None
    first = integrity.verify_dir(snapshot)
    assert (first.files, first.checked, first.remembered, first.corrupt) == (2, 2, 0, [])
    again = integrity.verify_dir(snapshot)
    assert (again.checked, again.remembered) == (0, 2)
    blob = (snapshot / "config.json").resolve()
    os.utime(blob, ns=(1, 1))  # touched: hashed again
    assert integrity.verify_dir(snapshot).checked == 1


def test_a_corrupt_blob_is_named_by_its_path_and_forgotten(cache: Path) -> None:
    snapshot = sources.cached_snapshot("org/m", "main", cache)
    assert snapshot is not None
    integrity.verify_dir(snapshot)  # remembered as good ...
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] = 1  # ... then one byte flipped: same size, a new mtime
    blob.write_bytes(bytes(data))
    (bad,) = integrity.verify_dir(snapshot).corrupt
    assert bad.path == snapshot / "model.safetensors" and "hashes to" in bad.why
    spec = ModelSpec(key="m", capability="text_embedding", repo="org/m")
    with pytest.raises(ModelSourceError) as err:
        check_intact(spec, snapshot)
    assert str(snapshot / "model.safetensors") in str(err.value)
    assert "run `modelpool pull m --repair`" in str(err.value)


def test_a_truncated_safetensors_is_named_not_a_bare_safetensor_error(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(safetensors_bytes(1000)[:-100])
    spec = ModelSpec(key="local", capability="text_embedding", path=str(model))
    with pytest.raises(ModelSourceError) as err:
        check_intact(spec, model)
    assert str(model / "model.safetensors") in str(err.value) and "truncated" in str(err.value)
    (model / "model.safetensors").write_bytes(b"\x05")
    assert "too short" in (integrity.safetensors_problem(model / "model.safetensors") or "")
    (model / "model.safetensors").write_bytes(safetensors_bytes(10))
    check_intact(spec, model)  # whole again


def test_verify_and_pull_repair_through_the_cli(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    good = safetensors_bytes(1000)
    snapshot = sources.cached_snapshot("org/m", "main", cache)
    assert snapshot is not None
    (snapshot / "model.safetensors").resolve().write_bytes(good[:500])  # truncated blob
    assert main(["verify", "org/m"]) == 6
    assert f"corrupt: {snapshot / 'model.safetensors'}" in capsys.readouterr().out

    def fake_download(spec: ModelSpec) -> Path:  # what the hub would restore
        assert not (snapshot / "model.safetensors").exists()  # --repair removed it first
        add_file(cache, "org/m", "model.safetensors", good)
        return snapshot

    monkeypatch.setattr(cli_models, "download", fake_download)
    assert main(["pull", "org/m", "--repair"]) == 0
    assert "ok: org/m" in capsys.readouterr().out
    assert main(["verify", "org/m"]) == 0


def test_verify_of_a_model_not_pulled_names_the_pull(cache: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "org/absent"]) == 6
    assert "run `modelpool pull org/absent`" in capsys.readouterr().err
