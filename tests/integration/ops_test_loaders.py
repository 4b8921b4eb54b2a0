"""Custom loaders for the operator tests (tests/integration/test_cli_ops.py): a vision
model that answers with the image's size, without torch. Imported in worker processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from modelpool.protocol.messages import Describe
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats


class SizeDescriber:
    def info(self) -> dict[str, Any]:
        return {"context": 4096}

    def describe(self, image: Image.Image, request: Describe,
                 stats: GenerationStats) -> Iterator[str]:
        stats.prompt_tokens = len(request.prompt.split())
        for piece in (f"{image.width}", "x", f"{image.height}"):
            stats.completion_tokens += 1
            yield piece
        stats.finish_reason = "stop"


def size_describer(spec: ModelSpec, model_dir: Path | None) -> SizeDescriber:
    return SizeDescriber()
