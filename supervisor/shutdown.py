"""Graceful stop: refuse new work, drain what was accepted, then stop every worker
against one deadline. Every accepted request gets exactly one final reply."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor.pool import ModelState, Pool
from modelpool.supervisor.workers import WorkerHandle

log = logging.getLogger("modelpool.shutdown")

WORKER_STOP_GRACE_S = 3.0  # after the drain, for workers to exit before SIGKILL


async def drain_and_stop(pool: Pool) -> tuple[int, int]:
    """Returns (drained, cut): requests finished during the drain, and answered
    SHUTTING_DOWN because the drain ran out of time."""
    started = time.monotonic()
    pool.shutting_down = True
    pending = len(pool.active_jobs())
    deadline = started + pool.pool_config.shutdown_timeout_s
    while pool.active_jobs() and (remaining := deadline - time.monotonic()) > 0:
        pool.changed.clear()
        try:
            await asyncio.wait_for(pool.changed.wait(), timeout=remaining)
        except TimeoutError:
            break
    leftover = pool.active_jobs()
    for job in leftover:
        pool.book.fail(job, ErrorCode.SHUTTING_DOWN,
                  f"the daemon stopped before model {job.model_key!r} finished this request")
    await stop_all_workers(pool, WORKER_STOP_GRACE_S)
    log.info("stopped in %.2fs: %d request(s) drained, %d cut", time.monotonic() - started,
             pending - len(leftover), len(leftover))
    return pending - len(leftover), len(leftover)


async def stop_all_workers(pool: Pool, grace_s: float) -> None:
    """Serving workers first, then weights holders: on a GPU a worker maps its holder's
    memory, which must outlive it. One deadline for both; whatever is left is killed."""
    deadline = time.monotonic() + grace_s + 2.0
    for group in (_serving, _holders):
        for model in pool.models.values():
            for worker in group(model):
                pool.launcher.stop(worker, grace_s)
        while any(group(m) for m in pool.models.values()) and time.monotonic() < deadline:
            pool.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.changed.wait(), timeout=0.05)
    for model in pool.models.values():
        for worker in model.processes():
            log.warning("worker %d (pid %s) did not exit; killing it", worker.worker_id,
                        worker.pid)
            pool.launcher.kill(worker)


def _serving(model: ModelState) -> list[WorkerHandle]:
    return list(model.workers.values())


def _holders(model: ModelState) -> list[WorkerHandle]:
    return [model.holder] if model.holder else []
