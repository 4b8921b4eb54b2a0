"""text_embedding: texts in, one float32 vector per text out, many requests per forward pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from modelpool.protocol.messages import Embeddings
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import text_limits
from modelpool.workers.capabilities.base import Outbox, error_reply


class TextEmbeddingModel(Protocol):
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """A float32 array of shape (len(texts), dim)."""

    def info(self) -> dict[str, Any]:
        """Facts for the supervisor's status, e.g. {"dim": 384}."""

    # Optional: embed_counted(texts) -> (vectors, the tokens each text was read as), for
    # usage figures from the same tokenization; without it the counts are 0.


def run(model: TextEmbeddingModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    """Embed every item's texts in forward passes of at most max_batch texts."""
    texts = [text for item in items for text in item.request.texts]  # type: ignore[union-attr]
    texts = text_limits.clip(texts, text_limits.char_limit(model))
    try:
        vectors, counts = _embed_in_slices(model, texts, out, max_batch)
    except Exception as exc:
        if len(items) == 1:
            out.send(error_reply(items[0].job_id, exc))
            return
        # One bad input must not fail the requests it was batched with.
        for item in items:
            run(model, [item], out, max_batch)
        return
    row = 0
    for item in items:
        count = len(item.request.texts)  # type: ignore[union-attr]
        block = vectors[row : row + count]
        out.send(Embeddings(id=item.job_id, data=block.tobytes(), shape=list(block.shape),
                            tokens=sum(counts[row : row + count])))
        row += count


def _embed_in_slices(
    model: TextEmbeddingModel, texts: list[str], out: Outbox, max_batch: int
) -> tuple[np.ndarray, list[int]]:
    """The vectors, and the tokens each text was read as (zeros when the model cannot
    say)."""
    embed_counted = getattr(model, "embed_counted", None)
    if not callable(embed_counted):
        return in_slices(model.embed, texts, out, max_batch, "texts"), [0] * len(texts)
    counts: list[int] = []

    def embed(part: Sequence[str]) -> np.ndarray:
        vectors, tokens = embed_counted(part)
        counts.extend(int(n) for n in tokens)
        return vectors
    vectors = in_slices(embed, texts, out, max_batch, "texts")
    return vectors, counts if len(counts) == len(texts) else [0] * len(texts)


def in_slices(embed: Callable[[Sequence[Any]], np.ndarray], inputs: Sequence[Any],
              out: Outbox, max_batch: int, unit: str,
              cost: Callable[[Any], int] | None = None, budget: int = 0) -> np.ndarray:
    """Forward passes of at most max_batch inputs (and, with a cost, at most budget of
    it, an input alone excepted), one progress tick each; float32 rows."""
    parts = []
    for chunk in _slices(inputs, max_batch, cost, budget):
        vectors = np.ascontiguousarray(embed(chunk), dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(chunk):
            raise ValueError(f"model returned shape {vectors.shape} for {len(chunk)} {unit}")
        parts.append(vectors)
        out.tick()
    if not parts:
        return np.zeros((0, 0), dtype=np.float32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _slices(inputs: Sequence[Any], max_batch: int, cost: Callable[[Any], int] | None,
            budget: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    spent = 0
    for item in inputs:
        price = cost(item) if cost is not None else 0
        if chunk and (len(chunk) == max_batch or (cost is not None and spent + price > budget)):
            yield chunk
            chunk, spent = [], 0
        chunk.append(item)
        spent += price
    if chunk:
        yield chunk
