"""The job API's PoolStats: one daemon's figures, and a cluster's added up."""

from __future__ import annotations

from modelpool.protocol.jobs import PoolStats
from modelpool.supervisor.pool import Pool


def of_pool(pool: Pool, duplicates: int) -> PoolStats:
    models = list(pool.models.values())
    workers = [w for m in models for w in m.live_workers()]
    counters = [c for m in models for c in m.metrics.by_priority.values()]
    return PoolStats(
        workers=len(workers), busy_workers=sum(bool(w.jobs) for w in workers),
        active_jobs=sum(m.running() for m in models),
        queued_jobs=sum(len(m.queue) for m in models),
        memory_used_mb=round(pool.capacity.used_mb(models), 1),
        memory_budget_mb=round(pool.capacity.budget_mb, 1),
        completed=sum(c.completed for c in counters),
        failed=sum(c.failed + c.expired for c in counters),
        stored_results=0, mailbox_bytes=0, duplicate_results=duplicates)


def added_up(every: list[PoolStats], stored: int, nbytes: int, shared_queued: int) -> PoolStats:
    """Every node's figures summed; stored results and jobs waiting in the shared queue
    are counted once, from the mailbox and the queue."""
    return PoolStats(
        workers=sum(s.workers for s in every),
        busy_workers=sum(s.busy_workers for s in every),
        active_jobs=sum(s.active_jobs for s in every),
        queued_jobs=sum(s.queued_jobs for s in every) + shared_queued,
        memory_used_mb=round(sum(s.memory_used_mb for s in every), 1),
        memory_budget_mb=round(sum(s.memory_budget_mb for s in every), 1),
        completed=sum(s.completed for s in every), failed=sum(s.failed for s in every),
        stored_results=stored, mailbox_bytes=nbytes, nodes=len(every),
        duplicate_results=sum(s.duplicate_results for s in every))
