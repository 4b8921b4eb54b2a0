"""The memory ledger and eviction choice: pure functions."""

from __future__ import annotations

from modelpool.supervisor.memory import (
    EvictionCandidate,
    ModelCharge,
    never_fits,
    pick_evictions,
    room_for,
)


def test_weights_are_charged_once_and_workers_each() -> None:
    assert ModelCharge(weights_mb=100, per_worker_mb=30, workers=0).charged_mb == 0
    assert ModelCharge(weights_mb=100, per_worker_mb=30, workers=1).charged_mb == 130
    assert ModelCharge(weights_mb=100, per_worker_mb=30, workers=3).charged_mb == 190


def test_the_first_worker_pays_for_the_weights() -> None:
    cold = ModelCharge(weights_mb=100, per_worker_mb=30, workers=0)
    warm = ModelCharge(weights_mb=100, per_worker_mb=30, workers=1)
    assert cold.next_worker_mb == 130 and warm.next_worker_mb == 30


def test_room_for_counts_the_first_worker_with_its_weights() -> None:
    cold = ModelCharge(weights_mb=100, per_worker_mb=30, workers=0)
    assert room_for(cold, used_mb=0, budget_mb=129) == 0
    assert room_for(cold, used_mb=0, budget_mb=130) == 1
    assert room_for(cold, used_mb=0, budget_mb=160) == 2
    assert room_for(cold, used_mb=500, budget_mb=600) == 0
    warm = ModelCharge(weights_mb=100, per_worker_mb=30, workers=1)
    assert room_for(warm, used_mb=130, budget_mb=200) == 2


def test_never_fits_is_about_one_worker_alone() -> None:
    assert never_fits(ModelCharge(weights_mb=900, per_worker_mb=200, workers=0), 1000)
    assert not never_fits(ModelCharge(weights_mb=700, per_worker_mb=200, workers=0), 1000)


def cand(worker_id: int, model: str, last_used: float, workers: int = 1) -> EvictionCandidate:
    return EvictionCandidate(worker_id, model, last_used, per_worker_mb=30, weights_mb=100,
                             model_workers=workers)


def test_evicts_least_recently_used_first_until_enough() -> None:
    candidates = [cand(1, "a", last_used=50), cand(2, "b", last_used=10),
                  cand(3, "c", last_used=30)]
    assert pick_evictions(candidates, need_mb=120) == [2]  # one whole model frees 130
    assert pick_evictions(candidates, need_mb=200) == [2, 3]


def test_the_last_worker_of_a_model_frees_its_weights_too() -> None:
    # Two workers of "a": the first eviction frees 30, the second 30 + the weights.
    candidates = [cand(1, "a", last_used=1, workers=2), cand(2, "a", last_used=2, workers=2)]
    assert pick_evictions(candidates, need_mb=30) == [1]
    assert pick_evictions(candidates, need_mb=100) == [1, 2]


def test_no_eviction_when_it_cannot_make_enough_room() -> None:
    assert pick_evictions([cand(1, "a", last_used=1)], need_mb=1000) == []
    assert pick_evictions([], need_mb=1) == []
