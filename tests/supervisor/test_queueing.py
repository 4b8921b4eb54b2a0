"""JobQueue: priority then age, push_front, batch coalescing and lazy removal."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from modelpool.protocol.fields import PRIORITIES, Priority
from modelpool.protocol.kinds import KIND_OF
from modelpool.protocol.messages import Embed, Generate
from modelpool.supervisor.ageing import Ageing
from modelpool.supervisor.queueing import (
    PRIORITY_RANK,
    Job,
    JobQueue,
    JobState,
    QueuedTotals,
)


@dataclass
class FakeSink:
    closed: bool = False
    jobs: dict[int, Job] = field(default_factory=dict)
    sent: list[Any] = field(default_factory=list)

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


_ids = itertools.count(1)


def make_job(priority: Priority = "normal", texts: int = 1, generate: bool = False,
             owner: Hashable = "") -> Job:
    jid = next(_ids)
    request: Embed | Generate
    if generate:
        request = Generate(id=jid, prompt="p", priority=priority)
    else:
        request = Embed(id=jid, texts=["t"] * texts, priority=priority)
    return Job.of(jid, request, KIND_OF[type(request)], "m", 0.0, owner)


def cancel(queue: JobQueue, job: Job) -> None:
    """What the pool does on cancel/timeout of a queued job."""
    job.state = JobState.DONE
    queue.discard(job)


def drain(queue: JobQueue) -> list[Job]:
    out: list[Job] = []
    while batch := queue.pop_batch(1):
        out.extend(batch)
    return out


def test_priority_order_then_fifo() -> None:
    queue = JobQueue()
    jobs = [make_job(p) for p in ("batch", "low", "normal", "high", "critical")
            for _ in range(2)]
    for job in jobs:
        queue.push(job)
    popped = drain(queue)
    assert [j.request.priority for j in popped] == [
        "critical", "critical", "high", "high", "normal", "normal", "low", "low", "batch",
        "batch"]
    for prio in PRIORITIES:
        same = [j.job_id for j in popped if j.request.priority == prio]
        assert same == sorted(same)  # FIFO within one priority
    assert len(queue) == 0


def test_queues_sharing_totals_keep_what_they_hold_together() -> None:
    totals = QueuedTotals()
    a, b = JobQueue(totals), JobQueue(totals)
    jobs = [make_job() for _ in range(5)]
    for n, job in enumerate(jobs):
        job.nbytes = 10 * (n + 1)
        (a if n < 3 else b).push(job)
    assert (totals.live, totals.nbytes) == (5, 150)
    assert len(a.pop_batch(2)) == 2  # jobs[0] and jobs[1]
    cancel(b, jobs[4])
    assert (totals.live, totals.nbytes) == (2, 30 + 40)
    waiting = a.jobs() + b.jobs()
    assert (totals.live, totals.nbytes) == (len(waiting), sum(j.nbytes for j in waiting))


def test_push_front_goes_ahead_of_same_priority_only() -> None:
    queue = JobQueue()
    high, normal1, normal2 = make_job("high"), make_job("normal"), make_job("normal")
    for job in (high, normal1, normal2):
        queue.push(job)
    retried = make_job("normal")
    queue.push_front(retried)
    assert len(queue) == 4
    assert drain(queue) == [high, retried, normal1, normal2]


def test_pop_batch_coalesces_up_to_max_size() -> None:
    queue = JobQueue()
    a, b, c, d = make_job(texts=3), make_job(texts=4), make_job(texts=2), make_job(texts=1)
    for job in (a, b, c, d):
        queue.push(job)
    # 3 + 4 = 7; adding c (2) would make 9 > 8, so the batch stops before c (not skip it).
    assert queue.pop_batch(8) == [a, b]
    assert len(queue) == 2
    assert queue.pop_batch(8) == [c, d]
    assert queue.pop_batch(8) == []


def test_pop_batch_exact_fit() -> None:
    queue = JobQueue()
    jobs = [make_job(texts=2) for _ in range(3)]
    for job in jobs:
        queue.push(job)
    assert queue.pop_batch(4) == jobs[:2]
    assert len(queue) == 1


def test_oversized_job_is_returned_alone() -> None:
    queue = JobQueue()
    big, small = make_job(texts=50), make_job(texts=1)
    queue.push(big)
    queue.push(small)
    assert queue.pop_batch(8) == [big]
    assert queue.pop_batch(8) == [small]


def test_batch_respects_priority_order() -> None:
    queue = JobQueue()
    low, crit, normal = make_job("low"), make_job("critical"), make_job("normal")
    for job in (low, crit, normal):
        queue.push(job)
    assert queue.pop_batch(10) == [crit, normal, low]


def test_non_batched_returns_one_job() -> None:
    queue = JobQueue()
    jobs = [make_job(generate=True) for _ in range(3)]
    for job in jobs:
        queue.push(job)
    assert jobs[0].size == 1
    assert queue.pop_batch(32) == [jobs[0]]
    assert len(queue) == 2


def test_discarded_top_job_is_skipped() -> None:
    queue = JobQueue()
    a, b = make_job(), make_job()
    queue.push(a)
    queue.push(b)
    cancel(queue, a)
    assert len(queue) == 1
    assert queue.jobs() == [b]
    assert queue.pop_batch(1) == [b]
    assert len(queue) == 0
    assert queue.pop_batch(1) == []


def test_a_popped_job_that_ends_before_it_runs_is_not_counted_twice() -> None:
    queue = JobQueue()
    a, b = make_job(owner="x"), make_job(owner="x")
    queue.push(a)
    queue.push(b)
    assert queue.pop_batch(1) == [a]
    cancel(queue, a)  # its deadline passed, or its images found no room, after the pop
    assert len(queue) == 1 and queue.totals.nbytes == b.nbytes and queue.held == {"x": 1}
    assert queue.pop_batch(1) == [b]
    assert len(queue) == 0


def test_discarded_job_never_returned_unbatched() -> None:
    queue = JobQueue()
    a, b, c = make_job(), make_job(), make_job()
    for job in (a, b, c):
        queue.push(job)
    cancel(queue, b)
    assert len(queue) == 2
    assert drain(queue) == [a, c]
    assert len(queue) == 0


def test_discarded_job_never_returned_in_a_batch() -> None:
    queue = JobQueue()
    a, b, c = make_job(), make_job(), make_job()
    for job in (a, b, c):
        queue.push(job)
    cancel(queue, b)  # b is not at the top, so it stays in the heap until it surfaces
    assert queue.pop_batch(10) == [a, c]
    assert len(queue) == 0


# ---- fairness between clients ---------------------------------------------------------


def test_priority_rank_follows_priorities() -> None:
    assert [PRIORITY_RANK[p] for p in ("critical", "high", "normal", "low", "batch")] == [
        0, 1, 2, 3, 4]


# ---- property: a reference model of the queue ---------------------------------------

Op = tuple[Any, ...]
prio_st = st.sampled_from(PRIORITIES)
op_st = st.one_of(
    st.tuples(st.just("push"), prio_st, st.integers(1, 4)),
    st.tuples(st.just("push_front"), prio_st, st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 1000)),
    st.tuples(st.just("pop"), st.integers(1, 6)),
)


def check_ops(ops: list[Op], batched: bool) -> None:
    """Run ops on a JobQueue and on a sorted-list model; they must agree at every step.
    Batched: embeddings of 1-4 texts; unbatched: generations (always one at a time).

    The model orders by (rank, key): push keys count up, push_front keys count down, so
    a later push_front goes ahead of an earlier one (it is a stack within its priority).
    """
    queue = JobQueue()
    model: dict[Job, tuple[int, int]] = {}
    up, down = itertools.count(), itertools.count(-1, -1)
    popped: list[Job] = []
    discarded: set[int] = set()
    pushed: list[Job] = []
    for op in ops:
        if op[0] in ("push", "push_front"):
            job = make_job(op[1], texts=op[2], generate=not batched)
            pushed.append(job)
            front = op[0] == "push_front"
            (queue.push_front if front else queue.push)(job)
            model[job] = (PRIORITY_RANK[op[1]], next(down) if front else next(up))
        elif op[0] == "cancel" and model:
            victim = sorted(model, key=lambda j: j.job_id)[op[1] % len(model)]
            del model[victim]
            discarded.add(victim.job_id)
            cancel(queue, victim)
        elif op[0] == "pop":
            expected = _model_pop(model, op[1], batched)
            got = queue.pop_batch(op[1])
            assert got == expected
            for job in got:
                job.state = JobState.RUNNING
                del model[job]
            popped.extend(got)
        assert len(queue) == len(model)
        assert set(queue.jobs()) == set(model)
    popped.extend(drain(queue))
    ids = [j.job_id for j in popped]
    assert len(ids) == len(set(ids)), "a job was popped twice"
    assert not set(ids) & discarded, "a discarded job was popped"
    assert set(ids) | discarded == {j.job_id for j in pushed}
    assert len(queue) == 0


def _model_pop(model: dict[Job, tuple[int, int]], max_size: int, batched: bool) -> list[Job]:
    order = sorted(model, key=lambda j: model[j])
    if not order:
        return []
    batch, size = [order[0]], order[0].size
    for job in order[1:] if batched else []:
        if size >= max_size or size + job.size > max_size:
            break
        batch.append(job)
        size += job.size
    return batch


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=40))
def test_queue_matches_model_unbatched(ops: list[Op]) -> None:
    check_ops(ops, batched=False)


@settings(max_examples=300, deadline=None)
@example([("push", "normal", 1), ("push", "normal", 1), ("push", "normal", 1),
          ("cancel", 1), ("pop", 6)])
@given(st.lists(op_st, max_size=40))
def test_queue_matches_model_batched(ops: list[Op]) -> None:
    check_ops(ops, batched=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(prio_st, st.booleans()), max_size=30))
def test_push_order_within_priority(items: list[tuple[Priority, bool]]) -> None:
    """Jobs added with push() leave in arrival order within their priority."""
    queue = JobQueue()
    fronted: set[int] = set()
    for prio, front in items:
        job = make_job(prio)
        if front:
            fronted.add(job.job_id)
            queue.push_front(job)
        else:
            queue.push(job)
    popped = drain(queue)
    assert len(popped) == len(items)
    ranks = [PRIORITY_RANK[j.request.priority] for j in popped]
    assert ranks == sorted(ranks)
    for prio in PRIORITIES:
        pushed = [j.job_id for j in popped
                  if j.request.priority == prio and j.job_id not in fronted]
        assert pushed == sorted(pushed)


def test_a_starved_level_moves_up_one_level_at_a_time_in_order() -> None:
    queue, ageing = JobQueue(), Ageing()
    batch = [make_job("batch", owner=f"c{i}") for i in range(3)]
    for job in batch:
        queue.push(job)
    assert ageing.starved(queue, 0.0, 10) == []  # starts watching
    assert ageing.starved(queue, 9.0, 10) == []
    assert ageing.starved(queue, 10.0, 10) == [PRIORITY_RANK["batch"]]
    queue.lift(PRIORITY_RANK["batch"])
    assert [job.rank for job in batch] == [PRIORITY_RANK["low"]] * 3
    assert ageing.starved(queue, 20.0, 10) == [PRIORITY_RANK["low"]]
    queue.lift(PRIORITY_RANK["low"])
    normal = make_job("normal", owner="late")
    queue.push(normal)
    assert drain(queue) == [*batch, normal]  # ahead of later work, in their own order


def test_a_level_that_is_served_or_empty_does_not_age() -> None:
    queue, ageing = JobQueue(), Ageing()
    for _ in range(3):
        queue.push(make_job("normal", owner="flood"))
    assert ageing.starved(queue, 0.0, 10) == []
    queue.pop_batch(1)  # served meanwhile: its clock starts again
    assert ageing.starved(queue, 15.0, 10) == []
    assert ageing.starved(queue, 24.0, 10) == []
    assert ageing.starved(queue, 25.0, 10) == [PRIORITY_RANK["normal"]]
    high, watch = JobQueue(), Ageing()
    high.push(make_job("high"))
    assert watch.starved(high, 0.0, 10) == watch.starved(high, 99.0, 10) == []  # the top
    assert ageing.starved(queue, 99.0, 0) == []  # 0: no ageing
