"""Operations on the pool that are not about one request: the periodic scale-down,
load/unload commands, and the status and model listings."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import time

import psutil

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import (
    DeviceMemory,
    MemoryStatus,
    ModelInfo,
    ModelStatus,
    PoolStatus,
    WorkerStatus,
)
from modelpool.supervisor import gpus, memory, recovery, scaling
from modelpool.supervisor.pool import ModelState, Pool
from modelpool.supervisor.workers import WorkerState


class ManagementError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def scale_down_tick(pool: Pool) -> None:
    """Retire one least-recently-used idle worker of each model idle for a full cooldown."""
    now = pool.clock()
    for model in pool.models.values():
        if not scaling.should_stop_one(pool.capacity.load_view(model), pool.policy, now):
            continue
        idle = [w for w in model.live_workers() if w.state is WorkerState.IDLE]
        if idle:
            victim = min(idle, key=lambda w: w.last_used)
            pool.launcher.stop(victim, pool.pool_config.shutdown_timeout_s + 1)
            model.last_scale_down = now


async def refresh_memory(pool: Pool) -> None:
    """Re-measure every ready worker's private memory (it grows with the batches it ran)
    and, on a GPU, every worker's and holder's whole VRAM, CUDA context included. In a
    thread: reading a process's smaps walks all its page tables, milliseconds for each
    worker, and nvidia-smi takes tens; either would stall every request on the loop."""
    targets = {worker.pid: (model, worker) for model in pool.models.values()
               for worker in model.processes() if worker.pid is not None
               and (worker.ready or worker.state is WorkerState.HOLDING)}
    uss, vram = await asyncio.get_running_loop().run_in_executor(
        None, _measure, list(targets), bool(pool.gpus))
    for pid, (model, worker) in targets.items():
        if not worker.alive:  # it exited while we measured
            continue
        if worker is model.holder:
            worker.uss_mb = uss.get(pid, worker.uss_mb)  # its weights are the model's
            model.measured_weights_mb = vram.get(pid, model.measured_weights_mb)
        else:
            pool.capacity.note_uss(model, worker, uss.get(pid))
            pool.capacity.note_vram(model, vram.get(pid))


def _measure(pids: list[int], on_gpus: bool) -> tuple[dict[int, float], dict[int, float]]:
    """(USS, VRAM) in MiB by pid; a process that is exiting is left out."""
    uss = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # exiting: its sentinel will tell
            uss[pid] = psutil.Process(pid).memory_full_info().uss / 2**20
    return uss, gpus.process_vram_mb() if on_gpus else {}


def _model(pool: Pool, name: str) -> ModelState:
    spec = pool.registry.resolve(name)
    if spec is None:
        raise ManagementError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
    return pool.models[spec.key]


def load_model(pool: Pool, name: str, workers: int) -> str:
    """Keep `workers` workers up (clearing a failed state) until `unload`, so requests
    never wait for a load. They start as load slots and memory allow."""
    model = _model(pool, name)
    if model.device is None or memory.never_fits(pool.capacity.charge(model),
                                                 pool.capacity.budget_for(model.device)):
        raise ManagementError(ErrorCode.INSUFFICIENT_MEMORY,
                              f"model {model.spec.key!r} has no device or can never fit "
                              f"its memory budget")
    model.load_failures, model.blocked_until, model.last_error = 0, 0.0, None
    model.last_failure_at = None
    model.warm_target = min(workers, pool.capacity.cpu_plan(model)[1])
    model.last_active = pool.clock()
    pool.reconcile(model)
    return (f"{model.spec.key}: keeping {model.warm_target} worker(s) up; "
            f"{len(model.live_workers())} live or starting")


def unload_model(pool: Pool, name: str) -> str:
    """Stop every worker of the model once its current work is done."""
    model = _model(pool, name)
    model.warm_target = 0
    live = model.live_workers()
    for worker in live:
        pool.launcher.stop(worker, pool.pool_config.shutdown_timeout_s + 1)
    recovery.stop_unused_holder(pool, model)  # else it stops after the last worker exits
    return f"{model.spec.key}: stopping {len(live)} worker(s)"


def model_state(pool: Pool, model: ModelState) -> str:
    if model.load_failures >= pool.pool_config.max_load_failures:
        return "failed"
    if any(w.ready for w in model.workers.values()):
        return "ready"
    processes = model.processes()
    if any(w.state in (WorkerState.STARTING, WorkerState.LOADING) for w in processes):
        return "loading"
    if processes:
        return "draining"
    if len(model.queue):
        return "waiting-for-memory" if model.waiting_for_memory else "waiting"
    return "cold"


def model_health(pool: Pool, model: ModelState, now: float) -> str:
    """"ok", or why not. Only models in use can be unhealthy: a cold one is fine."""
    key = model.spec.key
    if model.load_failures >= pool.pool_config.max_load_failures:
        return f"failed: {model.last_error}"
    if now < model.blocked_until and not any(w.ready for w in model.workers.values()):
        return f"load failing, retry in {model.blocked_until - now:.1f}s: {model.last_error}"
    timeout = pool.pool_config.heartbeat_timeout_s
    for worker in model.workers.values():
        if worker.hung:
            return f"worker pid {worker.pid} hung ({worker.hung}), being replaced"
        if worker.last_heartbeat is not None and now - worker.last_heartbeat > timeout:
            return f"worker pid {worker.pid} silent for {now - worker.last_heartbeat:.1f}s"
    if model.waiting_for_memory and len(model.queue):
        return f"{key} waits for memory"
    return "ok"


def build_status(pool: Pool, socket_path: str, started_at: float) -> PoolStatus:
    now = pool.clock()
    models = [_model_status(pool, m, now) for m in pool.models.values()]
    facts = memory.read_memory()
    return PoolStatus(
        pid=os.getpid(),
        version=version(),
        uptime_s=round(time.monotonic() - started_at, 3),
        socket=socket_path,
        shutting_down=pool.shutting_down,
        models=models,
        memory=MemoryStatus(
            budget_mb=round(pool.capacity.budget_mb, 1),
            used_mb=round(pool.capacity.used_mb(), 1),
            total_mb=round(facts.total_mb, 1),
            available_mb=round(facts.available_mb, 1),
            gpus=[DeviceMemory(device=g.device, budget_mb=round(pool.capacity.budget_for(
                g.device), 1), used_mb=round(pool.capacity.used_mb(g.device), 1),
                total_mb=g.total_mb) for g in pool.gpus],
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
            last_heartbeat_s=(round(now - w.last_heartbeat, 3)
                              if w.last_heartbeat is not None else None),
            load_s=w.load_s,
            holds_weights=w is model.holder,
        )
        for w in model.processes()
    ]
    queued, running = _by_priority(model)
    priorities = model.metrics.snapshot(queued, running)
    return ModelStatus(
        key=model.spec.key, capability=model.spec.capability, state=model_state(pool, model),
        queued=len(model.queue), running=model.running(),
        completed=sum(p.completed for p in priorities),
        failed=sum(p.failed + p.expired for p in priorities), workers=workers,
        last_error=model.last_error,
        memory_mb=round(pool.capacity.charge(model).charged_mb, 1),
        health=model_health(pool, model, now),
        priorities=priorities, mean_batch=round(model.metrics.mean_batch, 2),
        device=model.device,
    )


def _by_priority(model: ModelState) -> tuple[dict[str, int], dict[str, int]]:
    """Requesters waiting and running, per priority (a deduplicated job counts each)."""
    queued: collections.Counter[str] = collections.Counter()
    running: collections.Counter[str] = collections.Counter()
    for job in model.queue.jobs():
        queued.update(r.priority for r in job.live)
    for worker in model.workers.values():
        for job in worker.jobs.values():
            running.update(r.priority for r in job.live)
    return dict(queued), dict(running)


def models_info(pool: Pool) -> list[ModelInfo]:
    defaults = set(pool.registry.defaults.values())
    return [
        ModelInfo(key=m.spec.key, capability=m.spec.capability, aliases=list(m.spec.aliases),
                  source=m.spec.source, default=m.spec.key in defaults,
                  state=model_state(pool, m))
        for m in pool.models.values()
    ]


@functools.cache  # it scans the installed distributions: far too slow for every status
def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelpool")
    except PackageNotFoundError:
        return "0+unknown"
