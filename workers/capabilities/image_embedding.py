"""image_embedding: images in, one float32 vector per image out, batched like text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from PIL import Image

from modelpool.protocol.messages import Embed, Embeddings
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import text_embedding
from modelpool.workers.capabilities.base import Outbox, error_reply


class ImageEmbeddingModel(Protocol):
    def embed_images(self, images: Sequence[Image.Image]) -> np.ndarray:
        """A float32 array (len(images), dim), normalised as the model expects."""

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """The text tower, when the model has one (CLIP): texts land in the same space.
        Models without one raise PoolError(WRONG_CAPABILITY)."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"dim": 512, "image_size": 224, "text_tower": True}."""


def run(model: ImageEmbeddingModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    """Texts (the text tower) or images, never both in one batch (the queue keeps them
    apart). A bad image fails its own request only."""
    if all(isinstance(item.request, Embed) for item in items):
        text_embedding.run(model, items, out, max_batch)
        return
    decoded: list[tuple[WorkItem, list[Image.Image]]] = []
    for item in items:
        try:
            count = len(item.request.images)  # type: ignore[union-attr]
            decoded.append((item, [out.image(item, i) for i in range(count)]))
        except Exception as exc:
            out.send(error_reply(item.job_id, exc))
    images = [image for _, imgs in decoded for image in imgs]
    try:
        vectors = text_embedding.in_slices(model.embed_images, images, out, max_batch,
                                           "images")
    except Exception as exc:
        for item, _ in decoded:
            out.send(error_reply(item.job_id, exc))
        return
    row = 0
    for item, imgs in decoded:
        block = vectors[row : row + len(imgs)]
        row += len(imgs)
        out.send(Embeddings(id=item.job_id, data=block.tobytes(), shape=list(block.shape)))
