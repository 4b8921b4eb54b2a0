"""Operations on the pool that are not about one request: the periodic scale-down,
load/unload commands, and the status and model listings."""

from __future__ import annotations

import os
import time

from protocol.errors import ErrorCode
from protocol.messages import (
    MemoryStatus,
    ModelInfo,
    ModelStatus,
    PoolStatus,
    WorkerStatus,
)
from supervisor import memory, scaling
from supervisor.pool import ModelState, Pool
from supervisor.workers import WorkerState


class ManagementError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def scale_down_tick(pool: Pool) -> None:
    """Retire one least-recently-used idle worker of each model idle for a full cooldown."""
    now = pool.clock()
    for model in pool.models.values():
        if not scaling.should_stop_one(pool.load_view(model), pool.policy, now):
            continue
        idle = [w for w in model.live_workers() if w.state is WorkerState.IDLE]
        if idle:
            victim = min(idle, key=lambda w: w.last_used)
            pool.launcher.stop(victim, pool.pool_config.shutdown_timeout_s + 1)
            model.last_scale_down = now


def _model(pool: Pool, name: str) -> ModelState:
    spec = pool.registry.resolve(name)
    if spec is None:
        raise ManagementError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
    return pool.models[spec.key]


def load_model(pool: Pool, name: str, workers: int) -> str:
    """Start workers now (clearing a failed state) so first requests do not wait."""
    model = _model(pool, name)
    model.load_failures, model.blocked_until, model.last_error = 0, 0.0, None
    want = min(workers, pool.cpu_plan(model)[1]) - len(model.live_workers())
    for _ in range(max(0, want)):
        pool.start_worker(model)
    model.last_active = pool.clock()
    return f"{model.spec.key}: {len(model.live_workers())} worker(s) live or starting"


def unload_model(pool: Pool, name: str) -> str:
    """Stop every worker of the model once its current work is done."""
    model = _model(pool, name)
    live = model.live_workers()
    for worker in live:
        pool.launcher.stop(worker, pool.pool_config.shutdown_timeout_s + 1)
    return f"{model.spec.key}: stopping {len(live)} worker(s)"


def model_state(pool: Pool, model: ModelState) -> str:
    if model.load_failures >= pool.pool_config.max_load_failures:
        return "failed"
    workers = model.workers.values()
    if any(w.ready for w in workers):
        return "ready"
    if any(w.state in (WorkerState.STARTING, WorkerState.LOADING) for w in workers):
        return "loading"
    if workers:
        return "draining"
    if len(model.queue):
        return "waiting"  # work waits but no worker could start (memory or load slots)
    return "cold"


def build_status(pool: Pool, socket_path: str, started_at: float) -> PoolStatus:
    now = pool.clock()
    models = [_model_status(pool, m, now) for m in pool.models.values()]
    facts = memory.read_memory()
    return PoolStatus(
        pid=os.getpid(),
        version=_version(),
        uptime_s=round(time.monotonic() - started_at, 3),
        socket=socket_path,
        shutting_down=pool.shutting_down,
        models=models,
        memory=MemoryStatus(
            budget_mb=round(pool.pool_config.memory_fraction * facts.total_mb, 1),
            used_mb=round(pool.used_mb(), 1),
            total_mb=round(facts.total_mb, 1),
            available_mb=round(facts.available_mb, 1),
        ),
    )


def _model_status(pool: Pool, model: ModelState, now: float) -> ModelStatus:
    workers = [
        WorkerStatus(
            worker_id=w.worker_id,
            pid=w.pid,
            state=w.state.value,
            inflight=len(w.jobs),
            started_s_ago=round(now - w.started_at, 3),
            idle_s=round(now - w.last_used, 3) if w.state is WorkerState.IDLE else None,
            uss_mb=round(w.uss_mb, 1) if w.uss_mb is not None else None,
            last_heartbeat_s=(round(time.monotonic() - w.last_heartbeat, 3)
                              if w.last_heartbeat is not None else None),
            load_s=w.load_s,
        )
        for w in model.workers.values()
    ]
    return ModelStatus(
        key=model.spec.key, capability=model.spec.capability, state=model_state(pool, model),
        queued=len(model.queue), running=model.running(), completed=model.completed,
        failed=model.failed, workers=workers, last_error=model.last_error,
    )


def models_info(pool: Pool) -> list[ModelInfo]:
    defaults = set(pool.registry.defaults.values())
    return [
        ModelInfo(key=m.spec.key, capability=m.spec.capability, aliases=list(m.spec.aliases),
                  source=m.spec.source, default=m.spec.key in defaults,
                  state=model_state(pool, m))
        for m in pool.models.values()
    ]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelpool")
    except PackageNotFoundError:
        return "0+unknown"
