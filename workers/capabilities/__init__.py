"""The capability adapters: turn work items into calls on a loaded model and replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import (
    image_embedding,
    rerank,
    text_embedding,
    text_to_image,
    text_to_text,
    vision,
)
from modelpool.workers.capabilities.base import Outbox

Adapter = Callable[[Any, list[WorkItem], Outbox, int], None]
Preparer = Callable[[Any, WorkItem, Outbox], Any]

ADAPTERS: dict[str, Adapter] = {
    "text_embedding": text_embedding.run,
    "text_to_text": text_to_text.run,
    "image_embedding": image_embedding.run,
    "vision": vision.run,
    "text_to_image": text_to_image.run,
    "rerank": rerank.run,
}

# Capabilities whose models may batch their streams continuously (workers/streams.py):
# how one work item becomes a sequence for the model's decoder.
PREPARERS: dict[str, Preparer] = {
    "text_to_text": text_to_text.prepare,
    "vision": vision.prepare,
}
