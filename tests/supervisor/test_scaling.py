"""The scaling policy: pure functions of (model load, clock, room), tested with a fake clock."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from modelpool.supervisor import scaling
from modelpool.supervisor.scaling import ModelLoad, ScalingPolicy, should_stop_one, workers_to_start

NOW = 1_000.0  # the fake clock's reading
POLICY = ScalingPolicy(cold_start_workers=2, cooldown_idle_s=60.0)


def load(**changes: Any) -> ModelLoad:
    """A model with 2 ready workers, one busy, nothing queued, active just now."""
    base = ModelLoad(queued=0, live=2, starting=0, idle=1, busy=1, max_workers=4,
                     last_active=NOW, last_scale_down=0.0)
    return dataclasses.replace(base, **changes)


def cold(**changes: Any) -> ModelLoad:
    return load(**{"live": 0, "idle": 0, "busy": 0, "queued": 1, **changes})


def all_busy(**changes: Any) -> ModelLoad:
    return load(**{"queued": 3, "idle": 0, "busy": 2, **changes})


# ---- workers_to_start ----------------------------------------------------------------


def test_cold_start_starts_cold_start_workers() -> None:
    assert workers_to_start(cold(), POLICY, NOW, room=10) == 2


def test_cold_start_follows_policy() -> None:
    assert workers_to_start(cold(), ScalingPolicy(cold_start_workers=3), NOW, room=10) == 3


def test_cold_start_capped_by_max_workers() -> None:
    assert workers_to_start(cold(max_workers=1), POLICY, NOW, room=10) == 1


@pytest.mark.parametrize(("room", "expected"), [(2, 2), (1, 1), (0, 0), (-1, 0)])
def test_cold_start_capped_by_room(room: int, expected: int) -> None:
    assert workers_to_start(cold(), POLICY, NOW, room=room) == expected


def test_nothing_starts_without_queued_work() -> None:
    assert workers_to_start(cold(queued=0), POLICY, NOW, room=10) == 0
    assert workers_to_start(all_busy(queued=0), POLICY, NOW, room=10) == 0


def test_scale_up_by_one_when_all_busy() -> None:
    assert workers_to_start(all_busy(), POLICY, NOW, room=10) == 1


def test_no_scale_up_while_a_worker_is_idle() -> None:
    assert workers_to_start(all_busy(idle=1, busy=1), POLICY, NOW, room=10) == 0


def test_no_scale_up_while_a_worker_is_starting() -> None:
    # One start at a time per model: the starting worker will take the work.
    busy_and_starting = all_busy(live=3, starting=1)
    assert workers_to_start(busy_and_starting, POLICY, NOW, room=10) == 0


def test_no_scale_up_at_max_workers() -> None:
    assert workers_to_start(all_busy(max_workers=2), POLICY, NOW, room=10) == 0
    assert workers_to_start(all_busy(max_workers=3), POLICY, NOW, room=10) == 1


def test_no_scale_up_without_room() -> None:
    assert workers_to_start(all_busy(), POLICY, NOW, room=0) == 0


def test_no_start_while_backing_off() -> None:
    blocked = NOW + 5.0
    assert workers_to_start(cold(blocked_until=blocked), POLICY, NOW, room=10) == 0
    assert workers_to_start(all_busy(blocked_until=blocked), POLICY, NOW, room=10) == 0
    # Once the clock reaches blocked_until the back-off is over.
    assert workers_to_start(cold(blocked_until=blocked), POLICY, blocked, room=10) == 2


def test_no_start_when_failed() -> None:
    assert workers_to_start(cold(failed=True), POLICY, NOW, room=10) == 0
    assert workers_to_start(all_busy(failed=True), POLICY, NOW, room=10) == 0


# ---- should_stop_one -----------------------------------------------------------------


def idle_model(**changes: Any) -> ModelLoad:
    return load(**{"idle": 2, "busy": 0, "last_active": NOW, "last_scale_down": 0.0,
                   **changes})


def test_stop_after_cooldown_since_last_activity() -> None:
    model = idle_model()
    assert not should_stop_one(model, POLICY, NOW + 59.9)
    assert should_stop_one(model, POLICY, NOW + 60.0)  # the boundary counts (>=)
    assert should_stop_one(model, POLICY, NOW + 61.0)


def test_cooldown_counts_from_the_last_scale_down() -> None:
    # One worker per cooldown: after a stop at NOW + 60, the next waits until NOW + 120.
    model = idle_model(live=1, idle=1, last_scale_down=NOW + 60.0)
    assert not should_stop_one(model, POLICY, NOW + 119.0)
    assert should_stop_one(model, POLICY, NOW + 120.0)


def test_cooldown_follows_policy() -> None:
    short = ScalingPolicy(cooldown_idle_s=5.0)
    assert should_stop_one(idle_model(), short, NOW + 5.0)
    assert not should_stop_one(idle_model(), short, NOW + 4.0)


@pytest.mark.parametrize(
    "changes",
    [{"queued": 1}, {"busy": 1, "idle": 1}, {"starting": 1, "idle": 1}],
    ids=["queued", "busy", "starting"],
)
def test_no_stop_while_anything_is_happening(changes: dict[str, int]) -> None:
    assert not should_stop_one(idle_model(**changes), POLICY, NOW + 1_000.0)


def test_no_stop_without_live_workers() -> None:
    assert not should_stop_one(idle_model(live=0, idle=0), POLICY, NOW + 1_000.0)


@pytest.mark.parametrize(("cpus", "cold", "threads", "max_workers", "expected"), [
    (2, 2, 0, 0, (1, 2)),  # this machine: two one-thread workers share the two cores
    (16, 2, 0, 0, (8, 2)),
    (16, 2, 2, 0, (2, 8)),  # fewer threads each: more workers fit the cores
    (1, 2, 0, 0, (1, 2)),  # never below the cold-start count
    (8, 2, 4, 3, (4, 3)),  # explicit values win
])
def test_cpu_plan_shares_the_cores(cpus: int, cold: int, threads: int, max_workers: int,
                                   expected: tuple[int, int]) -> None:
    assert scaling.cpu_plan(cpus, cold, threads, max_workers) == expected
