"""ModelSpec, Registry lookup and defaults, preload_modules, and resolve_model_dir errors."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from modelpool.registry.download import ModelSourceError, resolve_model_dir
from modelpool.registry.loaders import (
    LOADER_MODULES_PRELOAD,
    custom_loader_modules,
    preload_modules,
)
from modelpool.registry.spec import ModelSpec, Registry, load_catalog

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def spec(key: str, capability: Any = "text_embedding", **fields: Any) -> ModelSpec:
    fields.setdefault("path", f"/models/{key}")
    return ModelSpec(key=key, capability=capability, **fields)


def catalogue_minilm() -> ModelSpec:
    return next(s for s in load_catalog() if s.key == MINILM)


# ---- Registry ------------------------------------------------------------------------


def test_resolve_by_key_and_alias_case_insensitively() -> None:
    a = spec("Org/Embedder", aliases=["emb", "Small-Emb"])
    registry = Registry([a, spec("other")])
    for name in ("Org/Embedder", "org/embedder", "EMB", "small-emb", "SMALL-EMB"):
        assert registry.resolve(name) is a, name
    other = registry.resolve("OTHER")
    assert other is not None and other.key == "other"


def test_unknown_name_resolves_to_none() -> None:
    registry = Registry([spec("a", aliases=["b"])])
    assert registry.resolve("c") is None
    assert registry.resolve("") is None


def test_later_spec_with_same_key_replaces_earlier() -> None:
    old, new = spec("m", aliases=["old"]), spec("m", aliases=["new"], path="/elsewhere")
    registry = Registry([old, new])
    assert registry.resolve("m") is new
    assert registry.resolve("new") is new
    assert registry.resolve("old") is None
    assert list(registry.specs) == ["m"]


@pytest.mark.parametrize("explicit_first", [True, False])
def test_explicit_default_wins(explicit_first: bool) -> None:
    plain, chosen = spec("plain"), spec("chosen", default=True)
    registry = Registry([chosen, plain] if explicit_first else [plain, chosen])
    assert registry.defaults["text_embedding"] == "chosen"


def test_first_model_is_default_without_an_explicit_one() -> None:
    registry = Registry([spec("first"), spec("second"),
                         spec("llm", capability="text_to_text")])
    assert registry.defaults == {"text_embedding": "first", "text_to_text": "llm"}


def test_catalogue_default_embedding_is_minilm() -> None:
    registry = Registry(load_catalog())
    assert registry.defaults["text_embedding"] == MINILM
    assert registry.resolve("MiniLM") is registry.specs[MINILM]


# ---- ModelSpec -----------------------------------------------------------------------


def test_source_strings() -> None:
    assert spec("a", path="/m/a").source == "path:/m/a"
    assert ModelSpec(key="b", capability="vision", package="pkg").source == "package:pkg"
    assert ModelSpec(key="b", capability="vision", package="pkg",
                     subdir="model").source == "package:pkg/model"
    assert ModelSpec(key="c", capability="vision", repo="org/c").source == "hub:org/c@main"
    assert ModelSpec(key="c", capability="vision", repo="org/c",
                     revision="v2").source == "hub:org/c@v2"
    assert ModelSpec(key="d", capability="vision",
                     loader="mod.sub:load").source == "loader:mod.sub:load"


def test_spec_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="only one of"):
        ModelSpec(key="x", capability="vision", path="/p", package="pkg")
    with pytest.raises(ValueError, match="needs path, package or repo"):
        ModelSpec(key="x", capability="vision")


def test_batched_and_streaming_flags() -> None:
    assert spec("e").batched and not spec("e").streaming
    llm = spec("l", capability="text_to_text")
    assert llm.streaming and not llm.batched


# ---- preload_modules -----------------------------------------------------------------


EMBEDDING_LOADER = "modelpool.registry.loaders.encoder_exec"
TORCH = "modelpool.workers.preload_torch"
ONNX = ["modelpool.registry.loaders.onnx_embedding", "onnxruntime", "tokenizers"]
EAGER = "modelpool.registry.loaders.sentence_embedding"


@pytest.fixture(autouse=True)
def _no_onnx_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty ONNX cache: MiniLM needs torch (a cached export: test_onnx_embedding)."""
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path / "cache"))


def test_preload_modules_for_catalogue_minilm() -> None:
    assert preload_modules([catalogue_minilm()]) == [
        EMBEDDING_LOADER, ONNX[0], EAGER, TORCH, ONNX[1], ONNX[2],
        "transformers.models.bert.modeling_bert"]


def test_preload_modules_without_config_json(tmp_path: Path) -> None:
    assert preload_modules([spec("empty", path=str(tmp_path))]) == [
        EMBEDDING_LOADER, ONNX[0], EAGER, TORCH, ONNX[1], ONNX[2]]
    # A hub model not in the hub cache: nothing, its worker imports what it needs once
    # the files have come (which takes longer than the imports).
    assert preload_modules([ModelSpec(key="h", capability="vision", repo="org/h")]) == []


def test_preload_modules_deduplicates_and_sorts(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({"model_type": "../evil"}))
    specs = [spec("a", path=str(tmp_path / "a")), spec("b", path=str(tmp_path / "b")),
             catalogue_minilm(), catalogue_minilm()]
    assert preload_modules(specs) == [EMBEDDING_LOADER, ONNX[0], EAGER, TORCH, ONNX[1], ONNX[2],
                                      "transformers.models.bert.modeling_bert",
                                      "transformers.models.llama.modeling_llama"]


def test_a_custom_loader_preloads_its_own_module_and_no_torch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    custom = [spec("c", path=str(tmp_path), loader="mine.embed:load"),
              spec("d", capability="rerank", loader="mine.embed:rank"),
              spec("e", loader="alpha:load")]
    assert preload_modules(custom) == [LOADER_MODULES_PRELOAD]
    assert custom_loader_modules(custom) == ["alpha", "mine.embed"]
    assert custom_loader_modules([catalogue_minilm()]) == []
    assert TORCH in preload_modules([*custom, catalogue_minilm()])


# ---- resolve_model_dir ---------------------------------------------------------------


def test_existing_path_resolves(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    assert resolve_model_dir(spec("p", path=str(tmp_path))) == tmp_path
    assert resolve_model_dir(spec("p", path=str(tmp_path), subdir="sub")) == tmp_path / "sub"


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelSourceError, match="no-such-model"):
        resolve_model_dir(spec("p", path=str(missing)))


def test_installed_package_resolves() -> None:
    model_dir = resolve_model_dir(catalogue_minilm())
    assert model_dir is not None and (model_dir / "config.json").is_file()


def test_missing_package_is_refused() -> None:
    absent = ModelSpec(key="x", capability="text_embedding",
                       package="modelpool_test_no_such_package")
    with pytest.raises(ModelSourceError, match=r"modelpool_test_no_such_package.*not installed"):
        resolve_model_dir(absent)


def test_loader_only_spec_has_no_dir() -> None:
    assert resolve_model_dir(ModelSpec(key="x", capability="vision", loader="m:f")) is None


def test_uncached_repo_offline_fails_fast(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    # A repo nobody has cached, in case huggingface_hub read the real cache dir at import.
    uncached = ModelSpec(key="x", capability="text_embedding",
                         repo="modelpool-tests/never-published")
    started = time.monotonic()
    with pytest.raises(ModelSourceError, match="not in the Hugging Face cache") as info:
        resolve_model_dir(uncached)
    assert time.monotonic() - started < 5.0
    assert "HF_HUB_OFFLINE" in str(info.value)
