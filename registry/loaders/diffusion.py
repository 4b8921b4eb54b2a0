"""Text-to-image with diffusers pipelines (Stable Diffusion and kin): seeded generation,
a callback after every denoising step for progress, previews and cancellation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import is_accelerate_available
from diffusers.utils import logging as diffusers_logging
from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import GenerateImage
from modelpool.registry.loaders.common import place, pretrained_kwargs, require_dir
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_image import StepCallback

PREVIEW_SIZE = 256  # longest side of a preview, in pixels


class _Stopped(Exception):
    """Raised from the step callback to leave the pipeline at once.

    The pipeline's own interrupt flag (pipe._interrupt) only skips the remaining steps:
    the final VAE decode (and safety checker) still run, seconds of wasted work on CPU for
    a result nobody wants. An exception skips those too."""


class Diffusion:
    def __init__(self, key: str, pipe: Any, max_size: int | None, preview_size: int) -> None:
        self.key = key
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)  # the worker reports progress itself
        self.scale = int(getattr(pipe, "vae_scale_factor", 8))
        # Latents are size // scale, so other sizes come out smaller than asked; the
        # pipelines also insist on multiples of 8.
        self.multiple_of = math.lcm(8, self.scale)
        self.native_size = _sample_size(pipe) * self.scale
        # Far beyond its training size a model repeats itself and the memory of the
        # attention layers explodes: twice the native size is the default ceiling.
        self.max_size = max_size or 2 * self.native_size
        self.preview_size = preview_size

    def info(self) -> dict[str, Any]:
        return {"pipeline": type(self.pipe).__name__,
                "scheduler": type(self.pipe.scheduler).__name__,
                "native_size": self.native_size, "max_size": self.max_size,
                "multiple_of": self.multiple_of}

    def check_size(self, width: int, height: int) -> None:
        for name, value in (("width", width), ("height", height)):
            if value % self.multiple_of or not self.multiple_of <= value <= self.max_size:
                raise PoolError(ErrorCode.BAD_REQUEST, (
                    f"{name} {value}: model {self.key!r} makes sizes that are multiples of "
                    f"{self.multiple_of} from {self.multiple_of} to {self.max_size}"))

    def generate_image(self, request: GenerateImage, seed: int,
                       on_step: StepCallback) -> Image.Image | None:
        self.check_size(request.width, request.height)
        # A CPU generator: the same seed gives the same initial noise on any device.
        generator = torch.Generator().manual_seed(seed)

        def step_end(pipe: Any, step: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            done = step + 1
            every = request.preview_every
            preview = self.preview(tensors["latents"]) if every and done % every == 0 else None
            # num_timesteps, not request.steps: some schedulers run extra steps (PNDM's
            # warm-up, Heun's second order), and the callback fires once per timestep.
            if not on_step(done, getattr(pipe, "num_timesteps", request.steps), preview):
                raise _Stopped
            return {}

        try:
            result = self.pipe(
                prompt=request.prompt, negative_prompt=request.negative_prompt or None,
                width=request.width, height=request.height,
                num_inference_steps=request.steps, guidance_scale=request.guidance,
                generator=generator, callback_on_step_end=step_end, output_type="pil")
        except _Stopped:
            return None
        return result.images[0]

    def preview(self, latents: torch.Tensor) -> Image.Image | None:
        """A small image of the current latents, or None for latents the VAE cannot take
        as they are (e.g. the packed sequences of Flux)."""
        if latents.ndim != 4:
            return None
        # Shrinking the latents first makes a preview cost a fraction of a full decode;
        # the VAE is convolutional and decodes any size.
        longest = max(latents.shape[-2:]) * self.scale
        shrink = math.ceil(longest / self.preview_size)
        if shrink > 1:
            latents = torch.nn.functional.interpolate(latents, scale_factor=1 / shrink,
                                                      mode="area")
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor
        if getattr(vae.config, "shift_factor", None):
            latents = latents + vae.config.shift_factor
        with torch.inference_mode():
            decoded = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(decoded, output_type="pil")[0]


def _sample_size(pipe: Any) -> int:
    """The latent size the model was trained at (64 for SD 1.x: 512 px)."""
    size = getattr(pipe, "default_sample_size", None)
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    if size is None and denoiser is not None:
        size = getattr(denoiser.config, "sample_size", None)
    if isinstance(size, (list, tuple)):
        size = max(size)
    return int(size or 64)


def load(spec: ModelSpec, model_dir: Path | None) -> Diffusion:
    model_dir = require_dir(spec, model_dir)
    # diffusers ignores HF_HUB_DISABLE_PROGRESS_BARS: without this every worker would draw
    # "Loading pipeline components" bars into the daemon's log.
    diffusers_logging.disable_progress_bar()
    # pretrained_kwargs' dtype is diffusers' own name since 0.42 (torch_dtype deprecated).
    # Without accelerate diffusers would warn on every load before falling back to the
    # plain loading path; asking for that path up front keeps worker logs clean.
    pipe = DiffusionPipeline.from_pretrained(
        model_dir, low_cpu_mem_usage=is_accelerate_available(), **pretrained_kwargs(spec))
    if not hasattr(pipe, "image_processor") or not hasattr(pipe, "vae"):
        raise ValueError(f"model {spec.key!r}: {type(pipe).__name__} is not a text-to-image "
                         "pipeline with a VAE")
    pipe = place(spec, pipe)
    max_size = spec.options.get("max_size")
    preview_size = int(spec.options.get("preview_size", PREVIEW_SIZE))
    return Diffusion(spec.key, pipe, int(max_size) if max_size else None, preview_size)
