"""The diffusion loader on the tiny random-weight Stable Diffusion pipeline: seeds, step
callbacks, previews, cancellation and sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.diffusion import Diffusion
from modelpool.registry.spec import ModelSpec

PROMPT = "a lighthouse on a cliff at dawn"

# diffusers 0.42's Euler scheduler calls np.array() on a torch tensor, which numpy 2.4
# flags on every set_timesteps; not ours to fix, and noise in every test report.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept")


@pytest.fixture(scope="module")
def sd(tiny_models_dir: Path) -> Diffusion:
    spec = ModelSpec(key="tiny-sd", capability="text_to_image",
                     path=str(tiny_models_dir / "tiny-sd"))
    model = load_model(spec)  # through DEFAULT_LOADERS, as the worker does
    assert isinstance(model, Diffusion)
    return model


class Steps:
    """An on_step callback that records its calls and can ask to stop at a step."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple[int, int, Image.Image | None]] = []
        self.stop_at = stop_at

    def __call__(self, step: int, total: int, preview: Image.Image | None) -> bool:
        self.calls.append((step, total, preview))
        return step != self.stop_at


def _generate(sd: Diffusion, seed: int = 1, on_step: Steps | None = None,
              **fields: Any) -> Image.Image | None:
    fields = {"prompt": PROMPT, "steps": 4, "width": 64, "height": 64, **fields}
    request = kinds.build("generate_image", **fields)
    return sd.generate_image(request, seed, on_step or Steps())


def _pixels(image: Image.Image | None) -> bytes:
    assert image is not None
    return image.tobytes()


def test_info(sd: Diffusion) -> None:
    assert sd.info() == {"pipeline": "StableDiffusionPipeline",
                         "scheduler": "EulerDiscreteScheduler",
                         "native_size": 64, "max_size": 128, "multiple_of": 8}


def test_same_seed_same_pixels_other_seed_other_pixels(sd: Diffusion) -> None:
    first = _generate(sd, seed=42)
    assert isinstance(first, Image.Image) and first.mode == "RGB"
    assert _pixels(first) == _pixels(_generate(sd, seed=42))
    assert _pixels(first) != _pixels(_generate(sd, seed=43))
    # Not a blank image: the random model still paints noise.
    assert np.asarray(first).std() > 1


def test_request_fields_reach_the_pipeline(sd: Diffusion) -> None:
    base = _pixels(_generate(sd))
    assert _pixels(_generate(sd, prompt="a red bicycle")) != base
    assert _pixels(_generate(sd, negative_prompt="blurry")) != base
    assert _pixels(_generate(sd, guidance=1.0)) != base
    assert _pixels(_generate(sd, steps=3)) != base


@pytest.mark.parametrize(("width", "height"), [(64, 64), (128, 64), (40, 96), (8, 8)])
def test_output_has_the_requested_size(sd: Diffusion, width: int, height: int) -> None:
    image = _generate(sd, width=width, height=height, steps=2)
    assert image is not None and image.size == (width, height)


def test_one_callback_per_step_without_previews(sd: Diffusion) -> None:
    steps = Steps()
    assert _generate(sd, steps=5, on_step=steps) is not None
    assert steps.calls == [(i, 5, None) for i in range(1, 6)]


def test_previews_at_every_nth_step(sd: Diffusion) -> None:
    steps = Steps()
    assert _generate(sd, steps=5, preview_every=2, on_step=steps) is not None
    assert [(step, total) for step, total, _ in steps.calls] == [(i, 5) for i in range(1, 6)]
    previews = {step: preview for step, _, preview in steps.calls}
    assert previews[1] is None and previews[3] is None and previews[5] is None
    for step in (2, 4):
        preview = previews[step]
        assert isinstance(preview, Image.Image)
        assert preview.size == (64, 64) and preview.mode == "RGB"
    # Each preview shows the latents of its own step.
    assert _pixels(previews[2]) != _pixels(previews[4])


def test_previews_are_shrunk_to_the_preview_size(
    sd: Diffusion, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sd, "preview_size", 32)
    steps = Steps()
    final = _generate(sd, width=128, height=64, steps=2, preview_every=1, on_step=steps)
    assert final is not None and final.size == (128, 64)
    assert all(p is not None and p.size == (32, 16) for _, _, p in steps.calls)


def test_stopping_returns_none_without_further_work(
    sd: Diffusion, monkeypatch: pytest.MonkeyPatch
) -> None:
    decodes: list[object] = []
    real_decode = sd.pipe.vae.decode

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        decodes.append(args)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(sd.pipe.vae, "decode", counting_decode)
    steps = Steps(stop_at=2)
    assert _generate(sd, steps=6, on_step=steps) is None
    assert [(step, total) for step, total, _ in steps.calls] == [(1, 6), (2, 6)]
    assert decodes == []  # no final decode of an image nobody will receive
    # The pipeline is usable again, with the same results as before.
    assert _pixels(_generate(sd, seed=9)) == _pixels(_generate(sd, seed=9))


@pytest.mark.parametrize(("width", "height"), [(136, 64), (64, 256), (36, 64), (64, 4)])
def test_sizes_the_model_cannot_make_are_bad_requests(
    sd: Diffusion, width: int, height: int
) -> None:
    steps = Steps()
    with pytest.raises(PoolError) as err:
        _generate(sd, width=width, height=height, on_step=steps)
    assert err.value.code == ErrorCode.BAD_REQUEST
    assert "128" in err.value.message
    assert steps.calls == []


def test_max_size_option(tiny_models_dir: Path) -> None:
    spec = ModelSpec(key="tiny-sd", capability="text_to_image",
                     path=str(tiny_models_dir / "tiny-sd"), options={"max_size": 256})
    model = load_model(spec)
    assert model.info()["max_size"] == 256
    image = model.generate_image(kinds.build("generate_image", PROMPT, steps=1, width=256,
                                             height=64), 0, Steps())
    assert image is not None and image.size == (256, 64)
