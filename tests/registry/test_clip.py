"""The CLIP loader on the tiny random-weight CLIP: image and text towers, normalisation,
batching, and agreement with plain transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.clip import ClipEmbedder
from modelpool.registry.spec import ModelSpec


@pytest.fixture(scope="module")
def clip_dir(tiny_models_dir: Path) -> Path:
    return tiny_models_dir / "tiny-clip"


@pytest.fixture(scope="module")
def clip(clip_dir: Path) -> ClipEmbedder:
    spec = ModelSpec(key="tiny-clip", capability="image_embedding", path=str(clip_dir))
    model = load_model(spec)  # through DEFAULT_LOADERS, as the worker does
    assert isinstance(model, ClipEmbedder)
    return model


def _images() -> list[Image.Image]:
    """Different sizes and contents, so the processor's resize and crop matter."""
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8), "RGB")
    gradient = Image.fromarray(np.tile(np.arange(0, 256, 4, dtype=np.uint8), (64, 1)), "L")
    return [noise, gradient.convert("RGB"), Image.new("RGB", (20, 70), (200, 30, 10))]


def _reference(clip_dir: Path, images: list[Image.Image] | None = None,
               texts: list[str] | None = None) -> np.ndarray:
    """What plain transformers computes, normalised as CLIP similarity expects."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir, use_safetensors=True).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        if images is not None:
            out = model.get_image_features(**processor(images=images, return_tensors="pt"))
        else:
            out = model.get_text_features(**processor(text=texts, padding=True,
                                                      return_tensors="pt"))
    features = out if isinstance(out, torch.Tensor) else out.pooler_output
    return torch.nn.functional.normalize(features, dim=-1).numpy()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_info(clip: ClipEmbedder) -> None:
    assert clip.info() == {"dim": 32, "image_size": 32, "text_tower": True,
                           "max_seq_length": clip.text_context}


def test_image_embeddings_match_transformers(clip: ClipEmbedder, clip_dir: Path) -> None:
    images = _images()
    vectors = clip.embed_images(images)
    assert vectors.dtype == np.float32
    assert vectors.shape == (len(images), clip.info()["dim"])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert _cosines(vectors, _reference(clip_dir, images=images)).min() >= 0.9999
    # Different images give different vectors (not one constant row).
    assert _cosines(vectors[:1], vectors[1:2])[0] < 0.9999


def test_batch_equals_single_images(clip: ClipEmbedder) -> None:
    images = _images()
    batch = clip.embed_images(images)
    single = np.concatenate([clip.embed_images([image]) for image in images])
    np.testing.assert_allclose(batch, single, rtol=0, atol=1e-6)


def test_non_rgb_images_are_converted(clip: ClipEmbedder) -> None:
    rng = np.random.default_rng(1)
    rgba = Image.fromarray(rng.integers(0, 256, (40, 40, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (40, 40), dtype=np.uint8), "L")
    palette = rgba.convert("RGB").convert("P")
    vectors = clip.embed_images([rgba, grey, palette])
    expected = clip.embed_images([im.convert("RGB") for im in (rgba, grey, palette)])
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-6)


def test_text_tower_shares_the_image_space(clip: ClipEmbedder, clip_dir: Path) -> None:
    texts = ["a photo of a cat", "a tiny model in a pool of workers", "rain"]
    vectors = clip.embed(texts)
    assert vectors.dtype == np.float32
    assert vectors.shape == (3, clip.embed_images(_images()[:1]).shape[1])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert _cosines(vectors, _reference(clip_dir, texts=texts)).min() >= 0.9999
    # Padding to the longest text of a batch must not change a text's vector.
    np.testing.assert_allclose(clip.embed(texts[2:]), vectors[2:], rtol=0, atol=1e-5)


def test_long_texts_are_cut_at_the_context(clip: ClipEmbedder) -> None:
    long_text = "the quick brown fox jumps over the lazy dog " * 40  # far over 77 tokens
    vectors = clip.embed([long_text, "short"])
    assert vectors.shape == (2, 32)
    assert np.isfinite(vectors).all()
    long_count, short_count = clip.embed_counted([long_text, "short"])[1]
    assert long_count == clip.text_context and 2 < short_count < 10  # as the tower reads them


def test_model_without_text_tower_refuses_texts(
    clip: ClipEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clip, "text_tower", False)
    with pytest.raises(PoolError) as err:
        clip.embed(["hello"])
    assert err.value.code == ErrorCode.WRONG_CAPABILITY


def test_bad_text_padding_option_is_refused(clip_dir: Path) -> None:
    spec = ModelSpec(key="tiny-clip", capability="image_embedding", path=str(clip_dir),
                     options={"text_padding": "sideways"})
    with pytest.raises(ValueError, match="text_padding"):
        load_model(spec)
