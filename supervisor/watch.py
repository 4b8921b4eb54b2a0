"""What the pool does with health.py's verdicts, checked every quarter second: a worker
starved at idle priority is raised, a hung one SIGKILLed (its exit re-queues its work
like any other death; a load that timed out or stalled is a load failure), and a late
one given no new work until it beats again (`Pool.handle_heartbeat`).

A function of the pool, which owns every piece of state it changes; `Pool.check_health`
calls `check`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from modelpool.supervisor import health

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Pool

log = logging.getLogger("modelpool.pool")


def check(pool: Pool) -> None:
    config = pool.pool_config
    limits = health.Limits(config.heartbeat_timeout_s, config.stall_timeout_s,
                           config.load_timeout_s, config.load_stall_s)
    now = pool.scheduler.now()
    for worker, verdict in list(health.hung_workers(pool.models.values(), now, limits)):
        if verdict.raise_priority:
            log.warning("worker %d (pid %s) of %s: %s: raising it to normal priority",
                        worker.worker_id, worker.pid, worker.model_key, verdict.reason)
            worker.raised_at = now
            pool.launcher.raise_priority(worker)
            continue
        log.warning("worker %d (pid %s) of %s is hung (%s): killing it",
                    worker.worker_id, worker.pid, worker.model_key, verdict.reason)
        if verdict.failed_load:
            worker.load_error = f"the load failed: {verdict.reason}"
        pool.kill_hung(worker, verdict.reason)
    late_s = health.late_after_s(config.heartbeat_interval_s, config.heartbeat_timeout_s)
    for worker in health.late_workers(pool.models.values(), now, late_s):
        worker.late = True
        log.warning("worker %d (pid %s) of %s silent for over %.1fs: no new work until "
                    "it beats again", worker.worker_id, worker.pid, worker.model_key, late_s)
