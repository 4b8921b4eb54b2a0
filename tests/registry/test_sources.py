"""Are a model's files there: paths, packages, and a fake Hugging Face cache laid out as
huggingface_hub lays it out (refs, snapshots of symlinks, blobs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelpool.registry import sources
from modelpool.registry.model_files import recommended_sampling
from modelpool.registry.spec import ModelSpec

COMMIT = "a" * 40


def fake_repo(cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    base = sources.repo_cache_dir(repo, cache)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(COMMIT)
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (base / "blobs").mkdir()
    for i, (name, data) in enumerate(files.items()):
        (base / "blobs" / f"blob{i}").write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    return snapshot


def test_a_repo_in_the_cache_is_found_by_branch_and_by_commit(tmp_path: Path) -> None:
    snapshot = fake_repo(tmp_path, "org/m", {"config.json": b"{}"})
    assert sources.cached_snapshot("org/m", "main", tmp_path) == snapshot
    assert sources.cached_snapshot("org/m", COMMIT, tmp_path) == snapshot
    assert sources.cached_snapshot("org/m", "v2", tmp_path) is None
    spec = ModelSpec(key="m", capability="text_embedding", repo="org/m")
    assert sources.missing_files(spec, tmp_path) is None


def test_a_repo_not_in_the_cache_names_the_pull_to_run(tmp_path: Path) -> None:
    spec = ModelSpec(key="qwen", capability="text_to_text", repo="org/q", revision="v2")
    missing = sources.missing_files(spec, tmp_path)
    assert missing is not None and missing.downloadable
    assert "run `modelpool pull qwen --revision v2`" in missing.message


def test_missing_paths_and_packages_are_named(tmp_path: Path) -> None:
    gone = ModelSpec(key="g", capability="text_embedding", path=str(tmp_path / "nope"))
    missing = sources.missing_files(gone)
    assert missing is not None and not missing.downloadable
    assert str(tmp_path / "nope") in missing.message
    pkg = ModelSpec(key="p", capability="text_embedding", package="no_such_pkg_for_mp")
    assert "'no_such_pkg_for_mp' is not installed" in sources.missing_files(pkg).message
    here = ModelSpec(key="h", capability="text_embedding", path=str(tmp_path))
    assert sources.missing_files(here) is None
    custom = ModelSpec(key="c", capability="text_embedding", loader="m:f")
    assert sources.missing_files(custom) is None


def test_the_cache_follows_huggingface_hubs_variables(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert sources.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert sources.hub_cache_dir() == tmp_path / "c"


def test_download_progress_counts_partial_blobs(tmp_path: Path) -> None:
    fake_repo(tmp_path, "org/m", {"a.safetensors": b"x" * 2**20})
    blobs = sources.repo_cache_dir("org/m", tmp_path) / "blobs"
    (blobs / "next.incomplete").write_bytes(b"y" * 2**19)
    assert sources.download_progress_mb("org/m", tmp_path) == pytest.approx(1.5)
    assert sources.download_progress_mb("org/none", tmp_path) == 0.0


def test_a_partial_blob_means_a_download_under_way(tmp_path: Path) -> None:
    fake_repo(tmp_path, "org/m", {"config.json": b"{}"})
    assert not sources.partial_downloads("org/m", tmp_path)
    blobs = sources.repo_cache_dir("org/m", tmp_path) / "blobs"
    (blobs / "abc.incomplete").write_bytes(b"x")
    assert sources.partial_downloads("org/m", tmp_path)
    assert not sources.partial_downloads("org/none", tmp_path)


def test_a_hub_models_recommended_sampling_is_read_once_its_snapshot_is_here(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = ModelSpec(key="org/llm", capability="text_to_text", repo="org/llm")
    assert recommended_sampling(spec) == {}  # not downloaded yet
    snapshot = tmp_path / "models--org--llm" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--llm" / "refs").mkdir()
    (tmp_path / "models--org--llm" / "refs" / "main").write_text("abc")
    assert recommended_sampling(spec) == {}  # no generation_config.json
    (snapshot / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 2,'
        ' "repetition_penalty": 1.05, "max_new_tokens": 512, "max_length": 4096}')
    assert recommended_sampling(spec) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                          "repetition_penalty": 1.05, "max_tokens": 512}
