"""Where like requests went last, and the order of free workers it makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelpool.protocol import kinds
from modelpool.protocol.messages import ChatMessage, Generate
from modelpool.supervisor import affinity
from modelpool.supervisor.affinity import SLACK, Affinity, affine_first


@dataclass
class _Worker:
    worker_id: int
    jobs: dict[int, Any] = field(default_factory=dict)


def _running(worker_id: int, n: int) -> _Worker:
    return _Worker(worker_id, dict.fromkeys(range(n)))


def test_the_preferred_worker_goes_first_within_the_slack() -> None:
    free = [_running(1, 0), _running(2, 1), _running(3, SLACK)]
    assert [w.worker_id for w in affine_first(free, 3)] == [3, 1, 2]
    assert [w.worker_id for w in affine_first(free, 2)] == [2, 1, 3]
    assert [w.worker_id for w in affine_first(free, 1)] == [1, 2, 3]


def test_beyond_the_slack_or_not_free_the_order_stays() -> None:
    free = [_running(1, 0), _running(3, SLACK + 1)]
    assert [w.worker_id for w in affine_first(free, 3)] == [1, 3]
    assert [w.worker_id for w in affine_first(free, 9)] == [1, 3]  # gone, or no slot
    assert [w.worker_id for w in affine_first(free, None)] == [1, 3]


def test_the_least_recently_run_starts_are_forgotten(monkeypatch: Any) -> None:
    monkeypatch.setattr(affinity, "KEPT", 3)
    kept = Affinity()
    for start in "abcd":
        kept.ran(start, 1)
    kept.ran("b", 2)  # run again: now the most recent
    kept.ran("e", 1)
    assert list(kept.worker_of.items()) == [("d", 1), ("b", 2), ("e", 1)]


def _chat(*contents: str, salt: str = "") -> Generate:
    roles = ["system", "user", "assistant", "user"]
    return Generate(id=1, messages=[ChatMessage(role=r, content=c)
                                    for r, c in zip(roles, contents, strict=False)],
                    cache_salt=salt)


def test_a_conversations_turns_share_their_start_and_salts_keep_them_apart() -> None:
    start_of = kinds.BY_OP["generate"].affinity
    assert start_of is not None
    first = start_of(_chat("Be brief.", "Tell me about rivers."))
    assert start_of(_chat("Be brief.", "Tell me about rivers.", "Rivers flow.", "And?")) == first
    assert start_of(_chat("Be brief.", "Tell me about hills.")) != first
    assert start_of(_chat("Be brief.", "Tell me about rivers.", salt="t")) != first
    assert start_of(Generate(id=1, prompt="x" * 600)) == start_of(
        Generate(id=2, prompt="x" * 512 + "y"))
    assert start_of(Generate(id=1, prompt_ids=[1] * 200)) == start_of(
        Generate(id=2, prompt_ids=[1] * 128))
    assert all(k.affinity is None for k in kinds.KINDS if k.op != "generate")
