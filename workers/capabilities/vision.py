"""vision: an image and a question (or a chat, perhaps with more images) in, a stream of
text chunks out (like text_to_text)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Describe
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import text_limits
from modelpool.workers.capabilities.base import Outbox, error_reply
from modelpool.workers.capabilities.images import working_side
from modelpool.workers.capabilities.text_to_text import (
    GenerationStats,
    TextOutput,
    stream_text,
)


class VisionModel(Protocol):
    def describe(self, image: Image.Image, request: Describe,
                 stats: GenerationStats) -> Iterator[str]:
        """Yield one text piece per generated token (maybe ""), filling stats. A model
        that reads several images (`reads_many_images`) takes the request's others as
        the keyword `more`."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"context": 2048}."""


def _images(model: Any, item: WorkItem, out: Outbox
            ) -> tuple[Describe, Image.Image, dict[str, Any]]:
    """The request, its image, and its others (`more`) for a model that reads several."""
    request = item.request
    assert isinstance(request, Describe)
    chars = len(request.prompt) + sum(len(m.content) for m in request.messages)
    text_limits.check_prompt(chars, text_limits.char_limit(model))
    if request.more_images and not getattr(model, "reads_many_images", False):
        raise PoolError(ErrorCode.BAD_REQUEST, "this model reads one image per request")
    side = working_side(model.info())
    image, *more = [opened.decoded(side) for opened in out.opened_images(item)]
    return request, image, {"more": more} if more else {}


def prepare(model: Any, item: WorkItem, out: Outbox) -> Any:
    """The item as a sequence for the model's continuous decoder (workers/streams.py)."""
    request, image, more = _images(model, item, out)
    return model.prepare(image, request, **more)


def _output(model: Any, request: Describe) -> TextOutput:
    """What reads the stream: the calls (tool_choice "auto") and a reasoning model's
    thinking, for a model that reads them."""
    calls = getattr(model, "tool_reader", None)
    think = getattr(model, "reasoning_reader", None)
    return TextOutput(request.sampling, None if calls is None else calls(request),
                      None if think is None else think(request))


def run(model: VisionModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    for item in items:  # streaming: the supervisor sends one item at a time
        try:
            request, image, more = _images(model, item, out)
            output = _output(model, request)
        except Exception as exc:
            out.send(error_reply(item.job_id, exc))
            continue
        stats = GenerationStats()
        stream_text(item.job_id, lambda i=image, r=request, s=stats, m=more: model.describe(
            i, r, s, **m), stats, output, out)
