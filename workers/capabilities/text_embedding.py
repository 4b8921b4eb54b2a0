"""text_embedding: texts in, one float32 vector per text out, many requests per forward pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from modelpool.protocol.errors import ErrorCode, PoolError
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
    # Optional: matryoshka_dimensions, a list of the sizes its vectors may be shortened
    # to ([]: any), for requests' `dimensions` (shortened); without it they are refused.


def run(model: TextEmbeddingModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    """Embed every item's texts in forward passes of at most max_batch texts."""
    texts = [text for item in items for text in item.request.texts]  # type: ignore[union-attr]
    texts = text_limits.clip(texts, text_limits.char_limit(model))
    try:
        vectors, counts = _embed_in_passes(model, texts, out, max_batch)
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
        tokens = sum(counts[row : row + count])
        row += count
        dimensions = item.request.dimensions  # type: ignore[union-attr]
        try:
            block = block if dimensions is None else shortened(model, block, dimensions)
        except PoolError as exc:
            out.send(error_reply(item.job_id, exc))
            continue
        out.send(Embeddings(id=item.job_id, data=block.tobytes(), shape=list(block.shape),
                            tokens=tokens))


def shortened(model: Any, rows: np.ndarray, dimensions: int) -> np.ndarray:
    """Each row's first `dimensions` values, for a model trained so that they embed on
    their own (Matryoshka): its `matryoshka_dimensions` lists the sizes it was trained
    for ([]: any). Rows of unit length are renormalised, as OpenAI's shortened vectors and
    vLLM's are: cosine and dot product stay the same measure. Other models: BAD_REQUEST
    (their first values alone embed poorly), as vLLM refuses, unless the size asked is
    their own."""
    sizes = getattr(model, "matryoshka_dimensions", None)
    dim = rows.shape[1]
    if dimensions == dim:
        return rows  # asks for nothing: any model
    if sizes is None:
        raise PoolError(ErrorCode.BAD_REQUEST, f"dimensions: this model's vectors have "
                        f"{dim} values and it does not say it was trained to be shortened "
                        "(Matryoshka: the model option matryoshka_dimensions)")
    if dimensions > dim or (sizes and dimensions not in sizes):
        allowed = ", ".join(map(str, sizes)) if sizes else f"1 to {dim}"
        raise PoolError(ErrorCode.BAD_REQUEST,
                        f"dimensions: {dimensions} is not one this model offers ({allowed})")
    short = rows[:, :dimensions]
    unit = np.abs(np.linalg.norm(rows, axis=1, keepdims=True) - 1) < 1e-3
    lengths = np.maximum(np.linalg.norm(short, axis=1, keepdims=True), 1e-12)
    return np.where(unit, short / lengths, short).astype(np.float32)


# A forward pass pads every text to its longest, and costs about as much as 200 more
# characters of padding on top (MiniLM on this project's 2-core machine, ONNX Runtime and
# eager alike: a batch of 32 mixed sentences split into four passes of similar lengths
# ran 1.3-1.6x faster than in one pass, into eight slower again).
PASS_COST_CHARS = 200
TEXT_COST_CHARS = 8  # the tokens every text gets besides its own ([CLS], [SEP])


def _embed_in_passes(
    model: TextEmbeddingModel, texts: list[str], out: Outbox, max_batch: int
) -> tuple[np.ndarray, list[int]]:
    """The vectors, and the tokens each text was read as (zeros when the model cannot
    say), from forward passes of texts of similar lengths (pass_groups)."""
    embed_counted = getattr(model, "embed_counted", None)
    counts = [0] * len(texts)
    vectors: np.ndarray | None = None
    groups = pass_groups([len(text) for text in texts], max_batch, PASS_COST_CHARS)
    for group in groups:
        part = texts if len(groups) == 1 else [texts[i] for i in group]
        if callable(embed_counted):
            rows, tokens = embed_counted(part)
            for i, n in zip(group, tokens, strict=False):
                counts[i] = int(n)
        else:
            rows = model.embed(part)
        rows = _rows(rows, len(part), "texts")
        if len(groups) == 1:
            vectors = rows  # every text, in order: no copy into place
        else:
            if vectors is None:
                vectors = np.empty((len(texts), rows.shape[1]), dtype=np.float32)
            vectors[group] = rows
        out.tick()
    return (vectors if vectors is not None else np.zeros((0, 0), np.float32)), counts


def pass_groups(lengths: list[int], max_batch: int, pass_cost: int) -> list[list[int]]:
    """The inputs' indices in forward passes of at most max_batch, grouped by length so
    that the passes' padding plus pass_cost each is least (a shortest path over the
    inputs sorted by length); each pass keeps the inputs' own order."""
    # All its padding costing less than one pass more (a lone text has none): one pass.
    if lengths and len(lengths) <= max_batch \
            and len(lengths) * max(lengths) - sum(lengths) < pass_cost:
        return [list(range(len(lengths)))]
    return shortest_passes(lengths, max_batch, pass_cost)


def shortest_passes(lengths: list[int], max_batch: int, pass_cost: int) -> list[list[int]]:
    """pass_groups by a shortest path: O(inputs x max_batch) steps in Python, ~75 us for
    a batch of 32 (a fifth of a no-op worker's CPU for the batch)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sizes = [lengths[i] + TEXT_COST_CHARS for i in order]
    best = [0.0] + [math.inf] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(max(0, end - max_batch), end):
            cost = best[start] + pass_cost + (end - start) * sizes[end - 1]
            if cost <= best[end]:  # ties: earlier passes full
                best[end], cut[end] = cost, start
    groups = []
    end = len(order)
    while end:
        groups.append(sorted(order[cut[end] : end]))
        end = cut[end]
    return groups[::-1]


def in_slices(embed: Callable[[Sequence[Any]], np.ndarray], inputs: Sequence[Any],
              out: Outbox, max_batch: int, unit: str,
              cost: Callable[[Any], int] | None = None, budget: int = 0) -> np.ndarray:
    """Forward passes of at most max_batch inputs (and, with a cost, at most budget of
    it, an input alone excepted), one progress tick each; float32 rows."""
    parts = []
    for chunk in _slices(inputs, max_batch, cost, budget):
        parts.append(_rows(embed(chunk), len(chunk), unit))
        out.tick()
    if not parts:
        return np.zeros((0, 0), dtype=np.float32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _rows(vectors: Any, count: int, unit: str) -> np.ndarray:
    """A forward pass's vectors as float32 rows, one per input, or ValueError."""
    rows = np.ascontiguousarray(vectors, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[0] != count:
        raise ValueError(f"model returned shape {rows.shape} for {count} {unit}")
    return rows


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
