"""text_to_image: a prompt in, progress per denoising step out, then one PNG image."""

from __future__ import annotations

import io
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from PIL import Image

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Error, GenerateImage, ImageProgress
from modelpool.protocol.messages import Image as ImageMsg
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities.base import Outbox, error_reply

# Called after every denoising step with (step, total_steps, preview or None); returns
# False to stop (cancel, timeout, shutdown). A preview is only built when asked for.
StepCallback = Callable[[int, int, "Image.Image | None"], bool]


class TextToImageModel(Protocol):
    def generate_image(self, request: GenerateImage, seed: int,
                       on_step: StepCallback) -> Image.Image | None:
        """The finished image, or None when on_step returned False."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"default_steps": 25, "max_size": 1024}."""


def run(model: TextToImageModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    for item in items:  # streaming: the supervisor sends one item at a time
        _run_one(model, item, out)


def _run_one(model: TextToImageModel, item: WorkItem, out: Outbox) -> None:
    request = item.request
    assert isinstance(request, GenerateImage)
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    seq = 0

    def on_step(step: int, total: int, preview: Image.Image | None) -> bool:
        nonlocal seq
        out.tick()
        if out.aborted(item.job_id):
            return False
        out.send(ImageProgress(id=item.job_id, seq=seq, step=step, total_steps=total,
                               preview_png=png_bytes(preview) if preview else None))
        seq += 1
        return True

    try:
        image = model.generate_image(request, seed, on_step)
    except Exception as exc:
        out.send(error_reply(item.job_id, exc))
        return
    if image is None:
        out.send(Error(id=item.job_id, code=ErrorCode.CANCELLED, message="stopped early"))
        return
    out.send(ImageMsg(id=item.job_id, png=png_bytes(image), width=image.width,
                      height=image.height, seed=seed))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
