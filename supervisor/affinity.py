"""Which worker of a model last ran requests that start alike (a conversation's turns, an
application's fixed instructions: the request kind's `affinity` says what they share), so
that the next of them goes where the worker's prefix cache holds that start, while the
worker is not much busier than the least loaded one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

# Streams a worker may run beyond the least loaded one's and still take a request that
# starts as one it ran: a decode step of a few more sequences costs less than prefilling
# the shared start again, which is hundreds of tokens for a conversation.
SLACK = 4
KEPT = 4096  # starts remembered per model, the least recently run forgotten first


class Candidate(Protocol):
    worker_id: int
    jobs: Mapping[int, Any]  # what it runs


class Affinity:
    """One model's starts and the worker each last went to (the dispatcher's to update)."""

    def __init__(self) -> None:
        self.worker_of: OrderedDict[Hashable, int] = OrderedDict()

    def ran(self, start: Hashable, worker_id: int) -> None:
        self.worker_of[start] = worker_id
        self.worker_of.move_to_end(start)
        if len(self.worker_of) > KEPT:
            self.worker_of.popitem(last=False)


W = TypeVar("W", bound=Candidate)


def affine_first(free: Sequence[W], preferred: int | None) -> list[W]:
    """`free` (least loaded first) with the preferred worker moved first, if it is among
    them and runs at most SLACK more streams than the least loaded."""
    chosen = next((w for w in free if w.worker_id == preferred), None)
    if chosen is None or len(chosen.jobs) > len(free[0].jobs) + SLACK:
        return list(free)
    return [chosen, *(w for w in free if w is not chosen)]
