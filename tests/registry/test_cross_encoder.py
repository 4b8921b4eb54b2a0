"""The eager cross-encoder loader on tiny-rerank, against sentence-transformers'
CrossEncoder (its ONNX export: test_onnx_rerank.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.cross_encoder import CrossEncoder
from modelpool.registry.spec import ModelSpec

PAIRS = [("what does a worker do", "a worker keeps one model loaded and runs it"),
         ("what does a worker do", "the queue holds requests by priority"),
         ("what does a worker do", "x"),
         ("how are images sent", "image bytes travel in shared memory")]


def _load(tiny_models_dir: Path, **options: object) -> CrossEncoder:
    spec = ModelSpec(key="tiny-rerank", capability="rerank", execution="eager",
                     path=str(tiny_models_dir / "tiny-rerank"), options=options)
    model = load_model(spec)
    assert isinstance(model, CrossEncoder)
    return model


def test_scores_match_sentence_transformers(tiny_models_dir: Path) -> None:
    from sentence_transformers import CrossEncoder as Reference

    expected = Reference(str(tiny_models_dir / "tiny-rerank")).predict(PAIRS)
    scores = _load(tiny_models_dir).score(PAIRS)
    assert scores.dtype == np.float32 and scores.shape == (len(PAIRS),)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(scores, 4))) == len(PAIRS)  # the documents are told apart


def test_a_pair_scores_the_same_alone_and_in_a_padded_batch(tiny_models_dir: Path) -> None:
    model = _load(tiny_models_dir)
    together = model.score(PAIRS)
    alone = np.concatenate([model.score([pair]) for pair in PAIRS])
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-6)


def test_raw_logits_without_the_sigmoid(tiny_models_dir: Path) -> None:
    raw = _load(tiny_models_dir, activation="none").score(PAIRS)
    sigmoid = _load(tiny_models_dir).score(PAIRS)
    np.testing.assert_allclose(1 / (1 + np.exp(-raw)), sigmoid, rtol=1e-5)


def test_long_pairs_are_truncated_to_max_length(tiny_models_dir: Path) -> None:
    model = _load(tiny_models_dir, max_length=16)
    assert model.info() == {"max_length": 16, "activation": "sigmoid", "execution": "eager",
                            "execution_reason": 'execution = "eager"'}
    scores = model.score([("query " * 50, "document " * 500)])
    assert scores.shape == (1,) and np.isfinite(scores).all()


def test_bad_options_are_refused(tiny_models_dir: Path) -> None:
    with pytest.raises(ValueError, match="activation"):
        _load(tiny_models_dir, activation="softmax")


def test_a_classifier_with_several_labels_is_no_reranker(tiny_models_dir: Path,
                                                         tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = tiny_models_dir / "tiny-rerank"
    model = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=3, ignore_mismatched_sizes=True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    spec = ModelSpec(key="three", capability="rerank", path=str(tmp_path))
    with pytest.raises(ValueError, match="3 output labels"):
        load_model(spec)
