"""image_embedding: images in, one float32 vector per image out, batched like text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from PIL import Image


class ImageEmbeddingModel(Protocol):
    def embed_images(self, images: Sequence[Image.Image]) -> np.ndarray:
        """A float32 array (len(images), dim), normalised as the model expects."""

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """The text tower, when the model has one (CLIP): texts land in the same space.
        Models without one raise PoolError(WRONG_CAPABILITY)."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"dim": 512, "image_size": 224, "text_tower": True}."""
