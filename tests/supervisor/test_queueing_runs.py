"""JobQueue.pop_batch takes a run of one user's jobs at once when that user is the only
one with work at its level. A run must leave the queue as taking the jobs one at a time
does: the same batches, and the same turns for everything popped after."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from modelpool.protocol.fields import Priority
from modelpool.protocol.kinds import KIND_OF
from modelpool.protocol.messages import Embed, Generate
from modelpool.supervisor.queueing import Job, JobQueue, JobState

OWNERS: list[Hashable] = [(1, "a"), (1, "b"), (2, "a"), "solo"]
PRIORITIES: list[Priority] = ["high", "normal", "normal", "batch"]


def one_at_a_time(queue: JobQueue, max_size: int) -> list[Job]:
    """pop_batch as it is without runs: every job through _top and _take."""
    top = queue._top()
    if top is None:
        return []
    first = top[1]
    batch = [queue._take(*top)]
    size = first.size
    while first.kind.batched and size < max_size and (top := queue._top()) is not None:
        if top[1].size + size > max_size or top[1].kind is not first.kind:
            break
        batch.append(queue._take(*top))
        size += top[1].size
    return batch


def make_job(job_id: int, priority: Priority, owner: Hashable, texts: int,
             generate: bool) -> Job:
    request: Embed | Generate = (
        Generate(id=job_id, prompt="p", priority=priority) if generate
        else Embed(id=job_id, texts=["t"] * texts, priority=priority))
    job = Job.of(job_id, request, KIND_OF[type(request)], "m", 0.0, owner)
    job.nbytes = 10 * texts
    return job


class Twin:
    """One queue popped with runs, one without, fed the same operations."""

    def __init__(self) -> None:
        self.queues = (JobQueue(), JobQueue())
        self.jobs: tuple[dict[int, Job], dict[int, Job]] = ({}, {})
        self.popped: tuple[list[list[int]], list[list[int]]] = ([], [])

    def apply(self, op: tuple[Any, ...]) -> None:
        name, *args = op
        for queue, jobs, popped in zip(self.queues, self.jobs, self.popped, strict=True):
            if name == "push":
                job_id, *fields = args
                jobs[job_id] = job = make_job(job_id, *fields)
                queue.push(job)
            elif name == "pop":
                pop = queue.pop_batch if queue is self.queues[0] else (
                    lambda size, q=queue: one_at_a_time(q, size))
                popped.append([job.job_id for job in pop(args[0])])
            elif (job := jobs.get(args[0])) is None or job.entry is None:
                continue  # not waiting: nothing to do
            elif name == "cancel":
                job.state = JobState.DONE
                queue.discard(job)
            elif name == "leave":  # out of QUEUED without a discard: skipped when met
                job.state = JobState.DONE
            elif name == "promote":
                queue.promote(job, 0)

    def same(self) -> None:
        runs, single = self.queues
        assert self.popped[0] == self.popped[1]
        assert (runs.live, runs.held, runs.served) == (single.live, single.held,
                                                       single.served)
        assert (runs.totals.live, runs.totals.nbytes) == (single.totals.live,
                                                          single.totals.nbytes)
        assert turns(runs) == turns(single)


def turns(queue: JobQueue) -> list[Any]:
    """Where each level and each user stands on its clock: what later turns follow from
    (heap entries' order numbers aside, which only break ties in the same order)."""
    return [(level.clock, level.live,
             {uid: (user.start, user.clock, user.live, user.finish)
              for uid, user in level.users.items()})
            for level in queue._levels]


job_ids = st.integers(1, 40)
push = st.tuples(st.just("push"), job_ids, st.sampled_from(PRIORITIES),
                 st.sampled_from(OWNERS), st.integers(1, 2),
                 st.sampled_from([False, False, False, True]))  # True: a Generate
ops = st.one_of(push, push, push, st.tuples(st.just("pop"), st.integers(1, 8)),
                st.tuples(st.sampled_from(["cancel", "leave", "promote"]), job_ids))


@settings(max_examples=400, deadline=None)
@given(st.lists(ops, min_size=8, max_size=60))
def test_runs_pop_what_one_at_a_time_pops(script: list[tuple[Any, ...]]) -> None:
    twin, pushed = Twin(), set()
    for op in script:
        if op[0] == "push" and op[1] in pushed:
            continue  # ids are unique
        pushed.add(op[1]) if op[0] == "push" else None
        twin.apply(op)
        twin.same()
    for _ in range(40):  # and everything left, in the same turns
        twin.apply(("pop", 4))
    twin.same()
    assert len(twin.queues[0]) == 0


def test_a_lone_clients_batch_is_one_run_in_its_order() -> None:
    twin = Twin()
    for job_id in range(1, 11):
        twin.apply(("push", job_id, "normal", "solo", 1, False))
    twin.apply(("pop", 8))
    twin.apply(("pop", 8))
    assert twin.popped[0] == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10]]
    twin.same()
