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
from modelpool.workers.capabilities.images import OpenedImage, working_side


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
    apart). Images are decoded one forward pass at a time, each pass at most max_batch
    images and max_pixels decoded pixels. A bad image fails its own request only."""
    if all(isinstance(item.request, Embed) for item in items):
        text_embedding.run(model, items, out, max_batch)
        return
    opened: list[tuple[WorkItem, list[OpenedImage]]] = []
    for item in items:
        try:
            opened.append((item, out.opened_images(item)))
        except Exception as exc:
            out.send(error_reply(item.job_id, exc))
    flat = [image for _, imgs in opened for image in imgs]
    try:
        vectors = _embed_lazily(model, flat, out, max_batch)
    except Exception as exc:
        if len(opened) == 1:
            out.send(error_reply(opened[0][0].job_id, exc))
        else:  # one undecodable image must not fail the requests batched with it
            for item, _ in opened:
                run(model, [item], out, max_batch)
        return
    finally:
        for image in flat:
            image.close()
    row = 0
    for item, imgs in opened:
        block = vectors[row : row + len(imgs)]
        row += len(imgs)
        out.send(Embeddings(id=item.job_id, data=block.tobytes(), shape=list(block.shape)))


def _embed_lazily(model: ImageEmbeddingModel, images: list[OpenedImage], out: Outbox,
                  max_batch: int) -> np.ndarray:
    side = working_side(model.info())

    def embed(chunk: Sequence[OpenedImage]) -> np.ndarray:
        try:
            return model.embed_images([image.decoded(side) for image in chunk])
        finally:
            for image in chunk:
                image.close()  # its pixels go before the next pass decodes more

    budget = images[0].policy.max_pixels if images else 0
    return text_embedding.in_slices(embed, images, out, max_batch, "images",
                                    cost=lambda image: image.pixels, budget=budget)
