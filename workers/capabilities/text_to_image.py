"""text_to_image: a prompt in, progress per denoising step out, then one PNG image."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from PIL import Image

from protocol.messages import GenerateImage

# Called after every denoising step with (step, total_steps, preview or None); returns
# False to stop (cancel, timeout, shutdown). A preview is only built when asked for.
StepCallback = Callable[[int, int, "Image.Image | None"], bool]


class TextToImageModel(Protocol):
    def generate_image(self, request: GenerateImage, seed: int,
                       on_step: StepCallback) -> Image.Image | None:
        """The finished image, or None when on_step returned False."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"default_steps": 25, "max_size": 1024}."""
