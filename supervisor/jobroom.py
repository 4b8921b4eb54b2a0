"""How many claimed jobs a model's queue in the pool takes now, the rest waiting in the
job queue in priority order (and, with a shared queue, free for another node).

Jobs wait per worker in a model's queue in the pool, the rest outside: small jobs of a
batched model coalesce there; a stream or an image holds its worker for its whole length,
so one waits beside each worker and the rest go to whichever daemon frees a worker first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modelpool.supervisor.pool import Pool

JOB_BACKLOG = 8
UNBATCHED_BACKLOG = 1


def room(pool: Pool, key: str, shared: bool, may_load: Callable[[str], bool]) -> int:
    """Jobs of the model that may join its queue in the pool: what its workers (or the
    ones a first job starts) can start now and a backlog that keeps them busy, and no
    more. may_load: whether this daemon may load the model (a cluster's say)."""
    model = pool.models.get(key)
    if model is None or model.retiring:
        return 0
    live = model.live_workers()
    if not live and not may_load(key):
        return 0  # in a cluster: another daemon serves it, or there is no room here
    if shared and not any(w.ready for w in live):
        # A load comes first: take the one job that starts it and leave the rest to
        # the nodes that have the model loaded, so that none waits behind this load.
        return max(0, 1 - len(model.queue))
    if model.spec.batched:
        return max(0, JOB_BACKLOG * max(1, len(live)) - len(model.queue))
    running = sum(len(w.jobs) for w in live)
    at_once = sum(streams_at_once(w) for w in live) or 1
    return max(0, at_once + UNBATCHED_BACKLOG * max(1, len(live)) - running
               - len(model.queue))


def free_now(pool: Pool, key: str) -> bool:
    """A worker of the model would take one more job at once: none waits for it."""
    model = pool.models.get(key)
    return model is not None and not len(model.queue) and bool(model.free_workers())


def streams_at_once(worker: Any) -> int:
    """How many jobs a worker of a model that does not batch runs at once: the streams
    it decodes together (continuous batching, as its loader reports), else one."""
    streams = worker.info.get("max_active_sequences")
    return streams if isinstance(streams, int) and streams > 0 else 1
