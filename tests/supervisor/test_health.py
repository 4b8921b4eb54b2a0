"""Hang detection: the pure verdict, and the pool acting on it with a fake clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from modelpool.protocol.messages import Embeddings
from modelpool.protocol.pipes import Heartbeat
from modelpool.supervisor.cli import _worker_text
from modelpool.supervisor.health import Limits, WorkerPulse, hung_reason, is_late, late_after_s
from modelpool.supervisor.status import build_status

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import FakeSink, Harness

    from modelpool.supervisor.workers import WorkerHandle

    MakeHarness = Callable[..., Harness]


LIMITS = Limits(heartbeat_timeout_s=5, stall_timeout_s=60, load_timeout_s=600,
                load_stall_s=120)


def pulse(last_heartbeat: float | None, progress_at: float = 0.0, busy: bool = False,
          loading: bool = False) -> WorkerPulse:
    return WorkerPulse(started_at=0.0, last_heartbeat=last_heartbeat,
                       progress_changed_at=progress_at, busy=busy, loading=loading)


def test_silence_past_the_timeout_is_a_hang() -> None:
    assert hung_reason(pulse(10.0), now=14.9, limits=LIMITS) is None
    verdict = hung_reason(pulse(10.0), now=15.1, limits=LIMITS)
    assert verdict is not None and "no heartbeat" in verdict.reason
    assert not verdict.failed_load  # the process is stuck, not its load


def test_a_worker_silent_since_its_start_is_raised_from_idle_priority_then_judged() -> None:
    assert hung_reason(pulse(None), now=4.0, limits=LIMITS) is None
    starved = hung_reason(pulse(None), now=6.0, limits=LIMITS)
    assert starved is not None and starved.raise_priority and not starved.failed_load
    raised = WorkerPulse(started_at=0.0, last_heartbeat=None, progress_changed_at=0.0,
                         busy=False, loading=True, raised_at=6.0)
    assert hung_reason(raised, now=10.9, limits=LIMITS) is None
    hung = hung_reason(raised, now=11.2, limits=LIMITS)
    assert hung is not None and not hung.raise_priority and "normal priority" in hung.reason


def test_a_worker_silent_while_it_loads_is_raised_then_judged() -> None:
    """Its heartbeat thread raised itself, but waits for the GIL that the loading
    thread, starved at idle priority, holds through a long C call: a priority inversion
    that only raising the whole process ends."""
    starved = hung_reason(pulse(1.0, loading=True), now=6.1, limits=LIMITS)
    assert starved is not None and starved.raise_priority and not starved.failed_load
    assert "last heartbeat 5.1s ago" in starved.reason
    raised = WorkerPulse(started_at=0.0, last_heartbeat=1.0, progress_changed_at=0.0,
                         busy=False, loading=True, raised_at=6.1)
    assert hung_reason(raised, now=11.0, limits=LIMITS) is None
    hung = hung_reason(raised, now=11.2, limits=LIMITS)
    assert hung is not None and not hung.raise_priority and "normal priority" in hung.reason
    # Beating again after the raise: a later silence counts from the last beat.
    recovered = WorkerPulse(started_at=0.0, last_heartbeat=20.0, progress_changed_at=0.0,
                            busy=False, loading=False, raised_at=6.1)
    assert hung_reason(recovered, now=24.9, limits=LIMITS) is None
    late = hung_reason(recovered, now=25.1, limits=LIMITS)
    assert late is not None and late.reason == "no heartbeat for 5.1s"
    # A loaded worker at serving priority has no idle priority to be starved at.
    serving = hung_reason(pulse(1.0), now=6.1, limits=LIMITS)
    assert serving is not None and not serving.raise_priority


def test_stalled_work_is_a_hang_only_while_busy() -> None:
    stalled = pulse(99.0, progress_at=30.0, busy=True)
    verdict = hung_reason(stalled, now=100.0, limits=LIMITS)
    assert verdict is not None and "no progress" in verdict.reason
    idle = pulse(99.0, progress_at=30.0, busy=False)
    assert hung_reason(idle, now=100.0, limits=LIMITS) is None


def test_a_load_that_stands_still_or_takes_too_long_fails() -> None:
    assert hung_reason(pulse(200.0, progress_at=100.0, loading=True), now=200.0,
                       limits=LIMITS) is None
    stalled = hung_reason(pulse(300.0, progress_at=100.0, loading=True), now=300.0,
                          limits=LIMITS)
    assert stalled is not None and stalled.failed_load and "load_stall_s" in stalled.reason
    slow = hung_reason(pulse(700.0, progress_at=699.0, loading=True), now=700.0,
                       limits=LIMITS)
    assert slow is not None and slow.failed_load and "load_timeout_s" in slow.reason
    # A loaded worker's idle progress counter is no stall.
    assert hung_reason(pulse(300.0, progress_at=100.0), now=300.0, limits=LIMITS) is None


def test_a_worker_is_late_after_four_missed_beats_or_half_its_timeout() -> None:
    assert late_after_s(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0) == 2.0
    assert late_after_s(heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0) == 1.0
    assert not is_late(pulse(10.0), now=12.0, late_s=2.0)
    assert is_late(pulse(10.0), now=12.1, late_s=2.0)
    assert not is_late(pulse(None), now=1.9, late_s=2.0)  # silent since its start at 0


async def _two_workers_one_running(h: Harness) -> tuple[FakeSink, int, WorkerHandle,
                                                          WorkerHandle]:
    """A request and the two workers it started: the first runs it, the second is idle;
    both have beaten once."""
    sink = h.sink()
    client_id = h.embed(sink, ["x"])
    await h.settle()
    first, second = h.workers("emb")
    h.ready(first)  # takes the job
    h.ready(second)
    for worker in (first, second):
        h.pool.handle_heartbeat(worker, Heartbeat(seq=0, progress=1))
    return sink, client_id, first, second


async def test_a_late_worker_gets_no_new_work_until_it_beats_again(
        make_harness: MakeHarness) -> None:
    h = make_harness(heartbeat_timeout_s=5, cold_start_workers=2, max_workers_per_model=2)
    sink, _, beating, late = await _two_workers_one_running(h)
    h.clock.advance(2.5)
    h.pool.handle_heartbeat(beating, Heartbeat(seq=1, progress=1))
    h.pool.check_health()
    assert late.late and not beating.late and h.launcher.killed == []
    status = msgspec.to_builtins(build_status(h.pool, "/s", h.clock.now()))
    texts = [_worker_text(w) for m in status["models"] for w in m["workers"]]
    assert sorted(texts) == sorted([f"{late.pid}:idle silent", f"{beating.pid}:busy"])

    waiting = h.embed(sink, ["y"])
    await h.settle()
    assert h.job_ids(late) == []  # idle, but silent: the request waits
    h.pool.handle_heartbeat(late, Heartbeat(seq=1, progress=1))
    (job_id,) = h.job_ids(late)
    h.reply_embeddings(late, job_id, 2.0)
    assert isinstance(sink.finals(waiting)[0], Embeddings)


async def test_work_waiting_on_a_late_worker_starts_another(
        make_harness: MakeHarness) -> None:
    h = make_harness(heartbeat_timeout_s=5, cold_start_workers=1, max_workers_per_model=2)
    sink = h.sink()
    h.embed(sink, ["x"])
    await h.settle()
    (late,) = h.workers("emb")
    h.ready(late)
    h.reply_embeddings(late, h.job_ids(late)[0], 1.0)
    h.want_work(late)
    h.pool.handle_heartbeat(late, Heartbeat(seq=0, progress=1))
    h.clock.advance(2.5)
    h.pool.check_health()
    h.embed(sink, ["y"])
    await h.settle()
    assert len(h.workers("emb")) == 2  # the late one counts as no idle worker


async def test_a_retry_waits_for_a_new_worker_rather_than_go_to_a_silent_sibling(
        make_harness: MakeHarness) -> None:
    """Both workers stopped, a second apart: the first's job, retried when it is killed,
    would die with the second (a job is retried once) if it were handed to it."""
    h = make_harness(heartbeat_timeout_s=5, cold_start_workers=2)
    sink, client_id, first, second = await _two_workers_one_running(h)
    h.clock.advance(1)
    h.pool.handle_heartbeat(second, Heartbeat(seq=1, progress=1))  # then stopped too
    for _ in range(24):  # a check every 0.25 s, until both are killed
        h.clock.advance(0.25)
        h.pool.check_health()
        await h.settle()
        assert h.job_ids(second) == []
    assert h.launcher.killed == [first, second]
    replacement = h.workers("emb")[2]
    h.ready(replacement)
    (job_id,) = h.job_ids(replacement)
    h.reply_embeddings(replacement, job_id, 3.0)
    assert isinstance(sink.finals(client_id)[0], Embeddings)


async def test_a_silent_worker_is_killed_and_its_work_requeued(
        make_harness: MakeHarness) -> None:
    h = make_harness(heartbeat_timeout_s=5, cold_start_workers=2)
    sink, client_id, first, second = await _two_workers_one_running(h)
    h.clock.advance(4)
    h.pool.handle_heartbeat(second, Heartbeat(seq=1, progress=1))
    h.pool.check_health()
    assert h.launcher.killed == []
    h.clock.advance(2)  # first: silent for 6 s
    h.pool.handle_heartbeat(second, Heartbeat(seq=2, progress=1))
    h.pool.check_health()
    assert h.launcher.killed == [first]
    status = {m.key: m for m in build_status(h.pool, "/s", 0.0).models}
    assert "hung" in status["emb"].health
    await h.settle()
    (job_id,) = h.job_ids(second)  # re-queued onto the healthy sibling
    h.reply_embeddings(second, job_id, 3.0)
    assert len(sink.finals(client_id)) == 1


async def test_busy_worker_without_progress_is_killed(make_harness: MakeHarness) -> None:
    h = make_harness(heartbeat_timeout_s=5, stall_timeout_s=30, cold_start_workers=1)
    h.generate(h.sink())
    await h.settle()
    (worker,) = h.workers("gen")
    h.ready(worker)
    for second in range(1, 40):
        h.clock.advance(1)
        h.pool.handle_heartbeat(worker, Heartbeat(seq=second, progress=7))  # alive, stuck
        h.pool.check_health()
        if h.launcher.killed:
            break
    assert h.launcher.killed == [worker]
    assert 30 <= second <= 32


async def test_a_slow_forkserver_does_not_make_a_new_worker_look_hung(
        make_harness: MakeHarness) -> None:
    h = make_harness(heartbeat_timeout_s=5, cold_start_workers=1)
    h.generate(h.sink())
    h.clock.advance(10)  # the forkserver took 10 s to import torch before forking
    await h.settle()
    h.pool.check_health()
    assert h.launcher.killed == []
    h.clock.advance(6)  # a spawned worker silent for 6 s may be starved: raised first
    h.pool.check_health()
    assert h.launcher.raised == h.workers("gen") and h.launcher.killed == []
    h.clock.advance(6)  # silent 6 s more at normal priority: hung
    h.pool.check_health()
    assert h.launcher.killed == h.workers("gen")
    assert h.launcher.raised == h.workers("gen")  # once
