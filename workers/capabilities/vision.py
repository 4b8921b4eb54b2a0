"""vision: an image and a question in, a stream of text chunks out (like text_to_text)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from PIL import Image

from protocol.messages import Describe
from workers.capabilities.text_to_text import GenerationStats


class VisionModel(Protocol):
    def describe(self, image: Image.Image, request: Describe,
                 stats: GenerationStats) -> Iterator[str]:
        """Yield one text piece per generated token (maybe ""), filling stats."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"context": 2048}."""
