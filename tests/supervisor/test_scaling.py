"""The scaling policy: pure functions of a frozen view of the pool and the clock that
return plans, tested with made-up views and a made-up clock."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from modelpool.supervisor import scaling
from modelpool.supervisor.memory import ModelCharge
from modelpool.supervisor.scaling import (
    ExportView,
    ModelLoad,
    ModelView,
    Plan,
    PoolView,
    ScalingPolicy,
    Start,
    Stop,
    plan_export,
    plan_scale_down,
    plan_starts,
    should_stop_one,
    workers_wanted,
)

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


# ---- workers_wanted -------------------------------------------------------------------


def test_cold_start_starts_cold_start_workers() -> None:
    assert workers_wanted(cold(), POLICY, NOW) == 2


def test_cold_start_follows_policy() -> None:
    assert workers_wanted(cold(), ScalingPolicy(cold_start_workers=3), NOW) == 3


def test_cold_start_capped_by_max_workers() -> None:
    assert workers_wanted(cold(max_workers=1), POLICY, NOW) == 1


def test_nothing_starts_without_queued_work() -> None:
    assert workers_wanted(cold(queued=0), POLICY, NOW) == 0
    assert workers_wanted(all_busy(queued=0), POLICY, NOW) == 0


def test_scale_up_by_one_when_all_busy() -> None:
    assert workers_wanted(all_busy(), POLICY, NOW) == 1


def test_no_scale_up_while_a_worker_is_idle() -> None:
    assert workers_wanted(all_busy(idle=1, busy=1), POLICY, NOW) == 0


def test_no_scale_up_while_a_worker_is_starting() -> None:
    # One start at a time per model: the starting worker will take the work.
    assert workers_wanted(all_busy(live=3, starting=1), POLICY, NOW) == 0


def test_no_scale_up_at_max_workers() -> None:
    assert workers_wanted(all_busy(max_workers=2), POLICY, NOW) == 0
    assert workers_wanted(all_busy(max_workers=3), POLICY, NOW) == 1


def test_no_start_while_backing_off() -> None:
    blocked = NOW + 5.0
    assert workers_wanted(cold(blocked_until=blocked), POLICY, NOW) == 0
    assert workers_wanted(all_busy(blocked_until=blocked), POLICY, NOW) == 0
    # Once the clock reaches blocked_until the back-off is over.
    assert workers_wanted(cold(blocked_until=blocked), POLICY, blocked) == 2


def test_no_start_when_failed() -> None:
    assert workers_wanted(cold(failed=True), POLICY, NOW) == 0
    assert workers_wanted(all_busy(failed=True), POLICY, NOW) == 0


def test_a_warm_minimum_starts_without_work() -> None:
    assert workers_wanted(cold(queued=0, warm=2), POLICY, NOW) == 2
    assert workers_wanted(load(warm=2), POLICY, NOW) == 0


def test_no_start_while_the_export_its_workers_must_run_is_made() -> None:
    assert workers_wanted(cold(awaits_export=True), POLICY, NOW) == 0
    assert workers_wanted(cold(queued=0, warm=1, awaits_export=True), POLICY, NOW) == 0


# ---- plan_starts: memory, load slots, eviction, holders -------------------------------


def charge(workers: int = 0, weights: float = 100, per_worker: float = 50) -> ModelCharge:
    return ModelCharge(weights_mb=weights, per_worker_mb=per_worker, workers=workers)


def view(*models: ModelView, budget: float = 1000, used: float = 0, loading: int = 0,
         freeing: frozenset[str] = frozenset()) -> PoolView:
    return PoolView(models={m.key: m for m in models}, loading=loading,
                    max_concurrent_loads=2, budget_mb={"cpu": budget},
                    used_mb={"cpu": used}, freeing=freeing)


def model(key: str = "a", load_: ModelLoad | None = None, **changes: Any) -> ModelView:
    base = ModelView(key=key, load=load_ or cold(), device="cpu", charge=charge())
    return dataclasses.replace(base, **changes)


def test_a_cold_start_that_fits_starts_its_workers() -> None:
    plan = plan_starts(view(model()), "a", POLICY, NOW)
    assert plan == Plan(start=(Start("a"), Start("a")), waiting_for_memory={"a": False})


def test_starts_are_capped_by_free_load_slots_and_memory() -> None:
    assert plan_starts(view(model(), loading=1), "a", POLICY, NOW).start == (Start("a"),)
    assert plan_starts(view(model(), loading=2), "a", POLICY, NOW) == Plan()
    # 1000 budget, 820 used: the weights (100) and one worker (50) fit, not a second.
    assert plan_starts(view(model(), used=820), "a", POLICY, NOW).start == (Start("a"),)


def test_no_room_evicts_the_least_recently_used_idle_workers_of_idle_models() -> None:
    idle_b = model("b", load(queued=0, live=2, idle=2, busy=0), charge=charge(workers=2),
                   idle_workers=((7, 50.0), (8, 10.0)))
    busy_c = model("c", load(queued=3), charge=charge(workers=1), idle_workers=((9, 1.0),))
    plan = plan_starts(view(model(), idle_b, busy_c, used=1000), "a", POLICY, NOW)
    # a needs 150; b's LRU worker frees 50, its second 50 + the weights 100.
    assert plan.stop == (Stop(8, "b", "evicted"), Stop(7, "b", "evicted"))
    assert plan.start == () and plan.waiting_for_memory == {"a": True}


def test_no_eviction_while_memory_is_already_being_freed() -> None:
    idle_b = model("b", load(queued=0), charge=charge(workers=2), idle_workers=((7, 1.0),))
    plan = plan_starts(view(model(), idle_b, used=1000, freeing=frozenset({"cpu"})), "a",
                       POLICY, NOW)
    assert plan == Plan(waiting_for_memory={"a": True})


def test_a_model_with_a_holder_starts_the_holder_first() -> None:
    assert plan_starts(view(model(uses_holder=True)), "a", POLICY, NOW).start == (
        Start("a", holder=True),)
    assert plan_starts(view(model(uses_holder=True, holder="loading")), "a", POLICY,
                       NOW).start == ()
    assert plan_starts(view(model(uses_holder=True, holder="stopping")), "a", POLICY,
                       NOW).start == ()
    assert plan_starts(view(model(uses_holder=True, holder="holding")), "a", POLICY,
                       NOW).start == (Start("a"), Start("a"))


def test_scale_down_stops_the_least_recently_used_idle_worker() -> None:
    idle = model("a", load(idle=2, busy=0, last_active=NOW - 60),
                 idle_workers=((1, 20.0), (2, 10.0)))
    assert plan_scale_down(view(idle), POLICY, NOW).stop == (Stop(2, "a", "idle"),)
    assert plan_scale_down(view(idle), POLICY, NOW - 1).stop == ()


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


# ---- plan_replacements ----------------------------------------------------------------


def outdated(*workers: tuple[int, bool], **changes: Any) -> ModelView:
    """Model "a": 2 ready workers (one busy) and charge for them, some outdated."""
    return model(load_=load(**changes), charge=charge(workers=2), outdated_workers=workers)


def test_an_idle_outdated_worker_is_replaced_one_at_a_time() -> None:
    plan = scaling.plan_replacements(view(outdated((7, False), (8, True))))
    assert plan == Plan(start=(Start("a"),), stop=(Stop(8, "a", "replaced"),))
    # The new worker loads: nothing more until it is ready.
    loading = outdated((7, False), starting=1, live=3)
    assert scaling.plan_replacements(view(loading, loading=1)) == Plan()


def test_a_busy_outdated_worker_is_replaced_only_while_another_serves() -> None:
    plan = scaling.plan_replacements(view(outdated((7, False))))
    assert plan.stop == (Stop(7, "a", "replaced"),) and plan.start == (Start("a"),)
    alone = outdated((7, False), live=1, idle=0, busy=1)
    assert scaling.plan_replacements(view(alone)) == Plan()
    alone_idle = outdated((7, True), live=1, idle=1, busy=0)
    assert scaling.plan_replacements(view(alone_idle)).stop == (Stop(7, "a", "replaced"),)


def test_without_memory_for_one_more_an_idle_outdated_worker_stops_alone() -> None:
    # 951 of 1000 used: less than one more worker's 50 left. Its successor starts in its
    # room when work asks for one.
    assert scaling.plan_replacements(view(outdated((8, True)), used=951)) == Plan(
        stop=(Stop(8, "a", "replaced"),))
    assert scaling.plan_replacements(view(outdated((7, False)), used=951)) == Plan()


def test_no_replacement_without_a_load_slot_or_outdated_workers() -> None:
    assert scaling.plan_replacements(view(outdated((8, True)), loading=2)) == Plan()
    assert scaling.plan_replacements(view(outdated())) == Plan()
    two = [outdated((8, True)), dataclasses.replace(outdated((9, True)), key="b")]
    plan = scaling.plan_replacements(view(*two, loading=1))
    assert len(plan.stop) == len(plan.start) == 1  # one slot: one replacement


# ---- background exports: they start when their peak fits and yield to workers -------


def test_the_oldest_waiting_export_that_fits_starts_while_none_runs() -> None:
    waiting = ExportView(waiting=(("big", 900.0), ("small", 500.0)))
    assert plan_export(dataclasses.replace(view(used=200), exports=waiting)) == Plan(
        start_export="small")
    assert plan_export(dataclasses.replace(view(used=50), exports=waiting)) == Plan(
        start_export="big")
    assert plan_export(dataclasses.replace(view(used=600), exports=waiting)) == Plan()
    running = ExportView(running_mb=300.0, waiting=waiting.waiting)
    assert plan_export(dataclasses.replace(view(), exports=running)) == Plan()


def test_a_start_that_needs_a_running_exports_memory_stops_it() -> None:
    # Budget 1000, workers 500, export 300: 200 free. A cold start of two workers needs
    # 100 + 50 + 50; with 10 more used, the second worker needs the export's memory.
    running = ExportView(running_mb=300.0)
    fits = dataclasses.replace(view(model(), used=500), exports=running)
    assert plan_starts(fits, "a", POLICY, NOW).start == (Start("a"), Start("a"))
    assert not plan_starts(fits, "a", POLICY, NOW).stop_export
    short = dataclasses.replace(view(model(), used=510), exports=running)
    plan = plan_starts(short, "a", POLICY, NOW)
    assert plan.start == (Start("a"), Start("a")) and plan.stop_export
    on_gpu = dataclasses.replace(short, models={"a": model(device="cuda:0")},
                                 budget_mb={"cpu": 1000, "cuda:0": 1000})
    assert not plan_starts(on_gpu, "a", POLICY, NOW).stop_export
