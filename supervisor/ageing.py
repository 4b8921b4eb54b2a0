"""Against starvation: a model's queue levels that have waited too long move up."""

from __future__ import annotations

from modelpool.protocol.fields import PRIORITIES
from modelpool.supervisor.queueing import PRIORITY_RANK, JobQueue

PROMOTION_FLOOR = PRIORITY_RANK["high"]  # ageing never lifts work into `critical`


class Ageing:
    """Against starvation: a priority level that has had work waiting, and none of it
    served, for `every` seconds moves that work up one level (never into `critical`), so
    a steady stream of urgent work cannot starve `batch` forever. It is the level that
    ages, not each job: a user whose backlog waits behind its own earlier requests is
    being served, and waiting longer earns it no place ahead of other users' fresh work
    (their turns stay fair). Pure: the caller passes the time."""

    def __init__(self) -> None:
        self.seen = [0] * len(PRIORITIES)  # the level's served count when last looked at
        self.since: list[float | None] = [None] * len(PRIORITIES)  # starved since

    def starved(self, queue: JobQueue, now: float, every: float) -> list[int]:
        """The levels to lift now, lowest priority last (work moves one level a time)."""
        lift = []
        for rank in range(PROMOTION_FLOOR + 1, len(PRIORITIES)):
            served, since = queue.served[rank], self.since[rank]
            if every <= 0 or not queue.waiting(rank) or served != self.seen[rank] \
                    or since is None:
                self.seen[rank], self.since[rank] = served, now
            elif now - since >= every:
                lift.append(rank)
                self.since[rank] = now
        return lift
