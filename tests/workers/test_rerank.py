"""The rerank adapter with a fake model: pairs in order, forward passes of max_batch
pairs, one Scores reply per request, and one bad request failing only itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Error, Rerank, Scores
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import rerank


class FakeModel:
    """Scores a pair by the length of its document; "BAD" in a query raises."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        self.calls.append(list(pairs))
        if any("BAD" in q for q, _ in pairs):
            raise ValueError("bad query")
        return np.array([len(d) for _, d in pairs], dtype=np.float64)

    def info(self) -> dict[str, Any]:
        return {}


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[msgspec.Struct] = []
        self.ticks = 0

    def send(self, msg: msgspec.Struct) -> None:
        self.sent.append(msg)

    def tick(self) -> None:
        self.ticks += 1


def item(job_id: int, query: str, *documents: str) -> WorkItem:
    return WorkItem(job_id=job_id, request=Rerank(id=job_id, query=query,
                                                  documents=list(documents)))


def scores(msg: msgspec.Struct) -> list[float]:
    assert isinstance(msg, Scores)
    return np.frombuffer(msg.data, dtype="<f4").tolist()


def test_each_request_gets_its_own_scores_from_shared_forward_passes() -> None:
    model, out = FakeModel(), FakeOutbox()
    rerank.run(model, [item(1, "q", "a", "bbb"), item(2, "r", "cc", "dddd", "e")], out, 2)
    assert [len(call) for call in model.calls] == [2, 2, 1] and out.ticks == 3
    assert model.calls[0] == [("q", "a"), ("q", "bbb")]
    assert model.calls[1] == [("r", "cc"), ("r", "dddd")]
    first, second = out.sent
    assert (first.id, scores(first), first.shape) == (1, [1.0, 3.0], [2])
    assert (second.id, scores(second), second.shape) == (2, [2.0, 4.0, 1.0], [3])


def test_a_failing_request_fails_alone() -> None:
    model, out = FakeModel(), FakeOutbox()
    rerank.run(model, [item(1, "q", "a"), item(2, "BAD", "b"), item(3, "r", "cc")], out, 8)
    by_id = {m.id: m for m in out.sent}  # type: ignore[attr-defined]
    assert scores(by_id[1]) == [1.0] and scores(by_id[3]) == [2.0]
    error = by_id[2]
    assert isinstance(error, Error) and error.code is ErrorCode.MODEL_ERROR
    assert "bad query" in error.message and len(out.sent) == 3


def test_a_model_that_returns_the_wrong_count_is_an_error() -> None:
    class Short(FakeModel):
        def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
            return np.zeros(len(pairs) - 1)

    out = FakeOutbox()
    rerank.run(Short(), [item(5, "q", "a", "b")], out, 8)
    (error,) = out.sent
    assert isinstance(error, Error) and "1 scores for 2 pairs" in error.message
