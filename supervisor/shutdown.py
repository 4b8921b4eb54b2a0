"""Graceful stop against one deadline: refuse new work, drain what was accepted until
`shutdown_timeout_s`, answer the rest SHUTTING_DOWN, then stop every worker and kill
what is still alive KILL_GRACE_S after that deadline. Every accepted request gets
exactly one final reply.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import psutil

from modelpool.protocol.cgroups import LOADING_ENV, SERVING_ENV
from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor import cgroups
from modelpool.supervisor.clock import wait_for
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.workers import WorkerHandle

log = logging.getLogger("modelpool.shutdown")

KILL_GRACE_S = 0.5  # after the drain's deadline, for workers and the forkserver to exit


async def drain_and_stop(pool: Pool) -> tuple[int, int, float]:
    """Returns (drained, cut, kill_at): requests finished during the drain, requests
    answered SHUTTING_DOWN because the drain ran out of time, and when anything still
    running is to be killed (the forkserver included)."""
    scheduler = pool.scheduler
    started = scheduler.now()
    deadline = started + pool.pool_config.shutdown_timeout_s
    pool.shutting_down = True
    await pool.exports.close()
    pending = len(pool.active_jobs())
    while pool.active_jobs():
        pool.changed.clear()
        if not await wait_for(scheduler, pool.changed, deadline):
            break
    leftover = pool.active_jobs()
    for job in leftover:
        pool.book.fail(job, ErrorCode.SHUTTING_DOWN,
                       f"the daemon stopped before model {job.model_key!r} finished this request")
    kill_at = min(scheduler.now(), deadline) + KILL_GRACE_S
    await stop_all_workers(pool, kill_at)
    leave_idle_priority()  # before the forkserver is stopped: nothing serves any more
    log.info("stopped in %.2fs: %d request(s) drained, %d cut", scheduler.now() - started,
             pending - len(leftover), len(leftover))
    return pending - len(leftover), len(leftover), kill_at


async def stop_all_workers(pool: Pool, kill_at: float) -> None:
    """Serving workers first, then weights holders: on a GPU a worker maps its holder's
    memory, which must outlive it. Whatever is alive at kill_at is killed."""
    for group in (_serving, _holders):
        for model in pool.models.values():
            for worker in group(model):
                pool.stop_worker(worker, grace_s=max(0.0, kill_at - pool.scheduler.now()))
        while any(group(m) for m in pool.models.values()):
            pool.changed.clear()
            if not await wait_for(pool.scheduler, pool.changed, kill_at):
                break
    for model in pool.models.values():
        for worker in model.processes():
            log.warning("worker %d (pid %s) did not exit; killing it", worker.worker_id,
                        worker.pid)
            pool.launcher.kill(worker)


def _serving(model: ModelState) -> list[WorkerHandle]:
    return list(model.workers.values())


def _holders(model: ModelState) -> list[WorkerHandle]:
    return [model.holder] if model.holder else []


def leave_idle_priority() -> None:
    """Whatever is left to exit (the forkserver, workers being killed) runs at normal
    priority from here: in the idle cgroup, or at SCHED_IDLE, a dying process gets no CPU
    while anything else wants it, and a killed forkserver (torch mapped) took up to 8 s
    to exit on a busy 2-core machine, holding the daemon's own exit that long."""
    serving, loading = os.environ.get(SERVING_ENV), os.environ.get(LOADING_ENV)
    if serving and loading:
        with contextlib.suppress(OSError):
            for pid in Path(loading, "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # gone meanwhile
                    Path(serving, "cgroup.procs").write_text(pid)
    for child in psutil.Process().children(recursive=True):
        cgroups.to_normal_priority(child.pid)
