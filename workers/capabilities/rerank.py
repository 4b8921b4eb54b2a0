"""rerank: a query and documents in, one float32 relevance score per document out,
(query, document) pairs of many requests scored in the same forward passes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from modelpool.protocol.messages import Rerank, Scores
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import text_limits
from modelpool.workers.capabilities.base import Outbox, error_reply


class RerankModel(Protocol):
    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """float32 relevance scores, shape (len(pairs),): higher is more relevant."""

    def info(self) -> dict[str, Any]:
        """Facts for status, e.g. {"max_length": 512, "activation": "sigmoid"}."""


def run(model: RerankModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    """Score every item's pairs in forward passes of at most max_batch pairs."""
    requests = [item.request for item in items]
    assert all(isinstance(r, Rerank) for r in requests)
    limit = text_limits.char_limit(model)
    pairs: list[tuple[str, str]] = []
    for r in requests:
        query = text_limits.clip([r.query], limit)[0]  # type: ignore[union-attr]
        pairs += [(query, doc) for doc in text_limits.clip(r.documents, limit)]  # type: ignore[union-attr]
    try:
        scores = _score_in_slices(model, pairs, out, max_batch)
    except Exception as exc:
        if len(items) == 1:
            out.send(error_reply(items[0].job_id, exc))
            return
        for item in items:  # one bad input must not fail the requests batched with it
            run(model, [item], out, max_batch)
        return
    row = 0
    for item, request in zip(items, requests, strict=True):
        block = scores[row : row + len(request.documents)]  # type: ignore[union-attr]
        row += len(block)
        out.send(Scores(id=item.job_id, data=block.tobytes(), shape=[len(block)]))


def _score_in_slices(model: RerankModel, pairs: list[tuple[str, str]], out: Outbox,
                     max_batch: int) -> np.ndarray:
    parts = []
    for start in range(0, len(pairs), max_batch):
        chunk = pairs[start : start + max_batch]
        scores = np.ascontiguousarray(model.score(chunk), dtype=np.float32).reshape(-1)
        if scores.shape != (len(chunk),):
            raise ValueError(f"model returned {scores.shape[0]} scores for {len(chunk)} pairs")
        parts.append(scores)
        out.tick()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
