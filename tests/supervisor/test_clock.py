"""The job book's heap of timers, driven by the fake scheduler: each callback runs once,
at its time, in order; a cancelled one never runs; the heap does not keep what is
cancelled."""

from __future__ import annotations

from conftest import FakeScheduler

from modelpool.supervisor.clock import TimerHeap


def test_timers_fire_at_their_time_in_order_and_cancelled_ones_never() -> None:
    clock = FakeScheduler()
    heap, fired = TimerHeap(clock), []
    heap.call_at(clock.now() + 3.0, fired.append, "c")
    heap.call_at(clock.now() + 1.0, fired.append, "a")
    dropped = heap.call_at(clock.now() + 2.0, fired.append, "b")
    heap.call_at(clock.now() + 2.0, lambda: fired.append(f"d at {clock.now() - 1000:g}"))
    dropped.cancel()
    clock.advance(0.999)
    assert fired == []
    clock.advance(1.5)
    assert fired == ["a", "d at 2"]
    clock.advance(10)
    assert fired == ["a", "d at 2", "c"]
    assert clock.pending() == 0 and len(heap) == 0


def test_one_scheduler_timer_for_many_of_the_same_delay() -> None:
    clock = FakeScheduler()
    heap = TimerHeap(clock)
    timers = []
    for _ in range(1000):
        timers.append(heap.call_at(clock.now() + 30.0, lambda: None))
        clock.advance(0.001)
    assert clock.pending() == 1


def test_an_earlier_timer_rearms_and_a_callback_may_add_or_cancel_timers() -> None:
    clock = FakeScheduler()
    heap, fired = TimerHeap(clock), []
    later = heap.call_at(clock.now() + 10.0, fired.append, "later")
    heap.call_at(clock.now() + 1.0, lambda: (fired.append("soon"), later.cancel(),
                                  heap.call_at(clock.now() + 1.0, fired.append, "added")))
    clock.advance(1.0)
    assert fired == ["soon"]
    clock.advance(20.0)
    assert fired == ["soon", "added"]


def test_cancelled_timers_are_dropped_once_they_are_most_of_the_heap() -> None:
    clock = FakeScheduler()
    heap = TimerHeap(clock)
    for _ in range(10_000):
        heap.call_at(clock.now() + 300.0, lambda: None).cancel()
    assert len(heap) <= 2 * 65
    keep = [heap.call_at(clock.now() + 300.0, lambda: None) for _ in range(100)]
    for _ in range(10_000):
        heap.call_at(clock.now() + 300.0, lambda: None).cancel()
    assert len(heap) <= 2 * len(keep) + 2 * 65
    fired = []
    heap.call_at(clock.now() + 300.0, fired.append, "last")
    clock.advance(301)
    assert fired == ["last"] and len(heap) == 0
