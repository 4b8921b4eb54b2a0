"""tiny-rerank through ONNX Runtime: exported once into the cache, its scores checked
against eager PyTorch's at every load, eager again when they differ."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import pytest

from modelpool.registry.loaders import (
    encoder_exec,
    exports_to_make,
    load_model,
    onnx_cache,
    onnx_rerank,
    preload_modules,
)
from modelpool.registry.loaders.cross_encoder import CrossEncoder
from modelpool.registry.loaders.onnx_rerank import OnnxReranker
from modelpool.registry.spec import ModelSpec

Execution = Literal["auto", "eager", "onnx"]
QUERY = "what does a worker do"
PAIRS = [(QUERY, "a worker keeps one model loaded and runs it"),
         (QUERY, "the queue holds requests by priority"), (QUERY, "x"),
         ("how are images sent", "image bytes travel in shared memory " * 40),
         ("q " * 300, "d " * 500)]  # both past max_length: truncated longest first


def _spec(tiny_models_dir: Path, execution: Execution = "auto", **options: object
          ) -> ModelSpec:
    return ModelSpec(key="tiny-rerank", capability="rerank", execution=execution,
                     path=str(tiny_models_dir / "tiny-rerank"), options=options)


@pytest.fixture(scope="module")
def cache(tiny_models_dir: Path, tiny_rerank_export: None) -> Path:
    """The run's cache, holding tiny-rerank's export as the daemons' tests use it and
    one with other options (made here)."""
    options = {"activation": "none", "max_length": 16}
    assert isinstance(load_model(_spec(tiny_models_dir, "onnx", **options)), OnnxReranker)
    return Path(os.environ["MODELPOOL_CACHE_DIR"])


@pytest.fixture
def in_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    def no_export(*_: object) -> None:
        raise AssertionError("exported again")

    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(cache))
    monkeypatch.setattr(encoder_exec, "export_in_child", no_export)
    return cache


def _eager(tiny_models_dir: Path, **options: object) -> CrossEncoder:
    model = load_model(_spec(tiny_models_dir, "eager", **options))
    assert isinstance(model, CrossEncoder)
    return model


@pytest.mark.parametrize("options", [{}, {"activation": "none", "max_length": 16}])
def test_the_export_scores_as_eager_in_a_batch_and_alone(
        in_cache: Path, tiny_models_dir: Path, options: dict[str, object]) -> None:
    model = load_model(_spec(tiny_models_dir, **options))  # "auto": the cached export
    assert isinstance(model, OnnxReranker)
    expected = _eager(tiny_models_dir, **options).score(PAIRS)
    together = model.score(PAIRS)
    assert together.dtype == np.float32 and together.shape == (len(PAIRS),)
    np.testing.assert_allclose(together, expected, rtol=1e-5, atol=1e-5)
    alone = np.concatenate([model.score([pair]) for pair in PAIRS])
    np.testing.assert_allclose(alone, expected, rtol=1e-5, atol=1e-5)
    info = model.info()
    assert info["activation"] == options.get("activation", "sigmoid")
    assert info["max_length"] == options.get("max_length", 128)  # tiny-rerank's positions
    assert info["execution"] == "onnx" and info["execution_reason"].endswith(", fused")


def test_each_set_of_options_has_its_own_entry_and_a_fused_graph(
        in_cache: Path, tiny_models_dir: Path) -> None:
    model_dir = tiny_models_dir / "tiny-rerank"
    plain = onnx_cache.entry_dir(_spec(tiny_models_dir), model_dir)
    raw = onnx_cache.entry_dir(_spec(tiny_models_dir, activation="none"), model_dir)
    assert plain != raw
    manifest = onnx_cache.read_manifest(plain)
    assert manifest is not None and manifest.choice == "onnx" and manifest.activation == "sigmoid"
    assert manifest.max_score_error is not None
    assert manifest.max_score_error <= onnx_rerank.MAX_SCORE_ERROR and manifest.checked
    ops = [node.op_type for node in onnx.load(str(plain / onnx_cache.MODEL_FILE),
                                              load_external_data=False).graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops  # tiny-rerank's 2 layers
    # An embedding model of the same files would be another entry.
    embedding = ModelSpec(key="e", capability="text_embedding", path=str(model_dir))
    assert onnx_cache.entry_dir(embedding, model_dir) != plain


def test_scores_that_differ_are_never_served(in_cache: Path, tiny_models_dir: Path,
                                             tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the entry whose reference scores are not the model's: "onnx" fails the
    load, "auto" runs eager PyTorch and says why."""
    model_dir = tiny_models_dir / "tiny-rerank"
    entry = onnx_cache.entry_dir(_spec(tiny_models_dir), model_dir)
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path))
    copy = onnx_cache.entry_dir(_spec(tiny_models_dir), model_dir)
    copy.mkdir(parents=True)
    for path in entry.iterdir():
        (copy / path.name).symlink_to(path)
    (copy / onnx_cache.REFERENCE_FILE).unlink()
    reference = np.load(entry / onnx_cache.REFERENCE_FILE)
    np.save(copy / onnx_cache.REFERENCE_FILE, reference + 1e-3)  # one score off is enough
    with pytest.raises(onnx_rerank.ScoresDiffer):
        load_model(_spec(tiny_models_dir, "onnx"))
    model = load_model(_spec(tiny_models_dir))
    assert isinstance(model, CrossEncoder)
    assert model.info()["execution"] == "eager"
    assert "ONNX scores differ" in model.info()["execution_reason"]


def test_auto_without_an_export_serves_eager_and_the_daemon_makes_it(
        tiny_models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(encoder_exec, "export_in_child", lambda *_: pytest.fail("exported"))
    spec, model_dir = _spec(tiny_models_dir), tiny_models_dir / "tiny-rerank"
    model = load_model(spec)
    assert isinstance(model, CrossEncoder)
    entry = onnx_cache.entry_dir(spec, model_dir)
    assert model.info()["onnx_export"] == {"entry": str(entry), "model_dir": str(model_dir)}
    eager = _spec(tiny_models_dir, "eager")
    assert exports_to_make([spec, eager]) == [(spec, model_dir, entry)]


def test_a_cached_export_needs_no_torch_in_the_forkserver(in_cache: Path,
                                                          tiny_models_dir: Path) -> None:
    assert preload_modules([_spec(tiny_models_dir)]) == [
        "modelpool.registry.loaders.encoder_exec",
        "modelpool.registry.loaders.onnx_embedding", "onnxruntime", "tokenizers"]
    eager = preload_modules([_spec(tiny_models_dir, "eager")])
    assert "modelpool.registry.loaders.cross_encoder" in eager
    assert "modelpool.workers.preload_torch" in eager
