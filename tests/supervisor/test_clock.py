"""The job book's heap of expiries, driven by the fake scheduler: each thing falls due
once, at its time, in order; one done before its time never does; the heap does not keep
what is done."""

from __future__ import annotations

from dataclasses import dataclass

from conftest import FakeScheduler

from modelpool.supervisor.clock import ExpiryHeap


@dataclass(eq=False)
class Thing:
    name: str
    done: bool = False


def due_log(clock: FakeScheduler) -> tuple[list[str], ExpiryHeap[Thing]]:
    fell_due: list[str] = []
    heap = ExpiryHeap(clock, lambda thing, at: fell_due.append(f"{thing.name} at {at - 1000:g}"))
    return fell_due, heap


def test_things_fall_due_at_their_time_in_order_and_done_ones_never() -> None:
    clock = FakeScheduler()
    fell_due, heap = due_log(clock)
    c, a, b, d = Thing("c"), Thing("a"), Thing("b"), Thing("d")
    heap.add(clock.now() + 3.0, c)
    heap.add(clock.now() + 1.0, a)
    heap.add(clock.now() + 2.0, b)
    heap.add(clock.now() + 2.0, d)
    b.done = True
    clock.advance(0.999)
    assert fell_due == []
    clock.advance(1.5)
    assert fell_due == ["a at 1", "d at 2"]
    clock.advance(10)
    assert fell_due == ["a at 1", "d at 2", "c at 3"]
    assert clock.pending() == 0 and len(heap) == 0


def test_one_scheduler_timer_for_many_of_the_same_delay() -> None:
    clock = FakeScheduler()
    _, heap = due_log(clock)
    for i in range(1000):
        heap.add(clock.now() + 30.0, Thing(str(i)))
        clock.advance(0.001)
    assert clock.pending() == 1


def test_an_earlier_thing_rearms_and_one_falling_due_may_add_or_end_others() -> None:
    clock = FakeScheduler()
    fell_due: list[str] = []
    later, soon, added = Thing("later"), Thing("soon"), Thing("added")

    def on_due(thing: Thing, at: float) -> None:
        fell_due.append(thing.name)
        if thing is soon:
            later.done = True
            heap.add(clock.now() + 1.0, added)

    heap = ExpiryHeap(clock, on_due)
    heap.add(clock.now() + 10.0, later)
    heap.add(clock.now() + 1.0, soon)
    clock.advance(1.0)
    assert fell_due == ["soon"]
    clock.advance(20.0)
    assert fell_due == ["soon", "added"]


def test_done_things_are_swept_once_the_heap_has_doubled() -> None:
    clock = FakeScheduler()
    fell_due, heap = due_log(clock)
    sweep_from = ExpiryHeap.SWEEP_FROM
    for i in range(10_000):
        thing = Thing(str(i))
        heap.add(clock.now() + 300.0, thing)
        thing.done = True
    assert len(heap) <= sweep_from + 1
    waiting = [Thing(f"w{i}") for i in range(2 * sweep_from)]
    for thing in waiting:
        heap.add(clock.now() + 300.0, thing)
    for i in range(10_000):
        thing = Thing(str(i))
        heap.add(clock.now() + 300.0, thing)
        thing.done = True
    assert len(heap) <= 2 * (len(waiting) + 1) + 1
    clock.advance(301)
    assert sorted(fell_due) == sorted(f"{t.name} at 300" for t in waiting)
    assert len(heap) == 0
