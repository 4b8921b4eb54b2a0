"""What the daemon reports about itself: `modelpool status` and `modelpool models`, and the
periodic re-measuring of workers' memory those figures (and the budget) rest on.

Reads the pool's state; the only changes it makes are measurements, through the
model's own note_* methods."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import time
from typing import Any

import psutil

from modelpool.protocol.messages import ModelInfo
from modelpool.protocol.pipes import token_limit
from modelpool.protocol.status import (
    ClusterStatus,
    DeviceMemory,
    MemoryStatus,
    ModelStatus,
    PoolStatus,
    WorkerStatus,
)
from modelpool.registry import sources
from modelpool.supervisor import gpus, memory
from modelpool.supervisor.models import LOADING, ModelState
from modelpool.supervisor.pool import Pool
from modelpool.supervisor.workers import WorkerHandle, WorkerState


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
            model.note_holder_measured(uss.get(pid), vram.get(pid))
        else:
            model.note_uss(worker, uss.get(pid))
            model.note_vram(vram.get(pid))


def _measure(pids: list[int], on_gpus: bool) -> tuple[dict[int, float], dict[int, float]]:
    """(USS, VRAM) in MiB by pid; a process that is exiting is left out."""
    uss = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # exiting: its sentinel will tell
            uss[pid] = psutil.Process(pid).memory_full_info().uss / 2**20
    return uss, gpus.process_vram_mb() if on_gpus else {}


def build_status(pool: Pool, socket_path: str, started_at: float,
                 cluster: ClusterStatus | None = None) -> PoolStatus:
    now = pool.scheduler.now()
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
            used_mb=round(pool.capacity.used_mb(pool.models.values()), 1),
            total_mb=round(facts.total_mb, 1),
            available_mb=round(facts.available_mb, 1),
            gpus=[DeviceMemory(device=g.device,
                               budget_mb=round(pool.capacity.budget_for(g.device), 1),
                               used_mb=round(pool.capacity.used_mb(pool.models.values(),
                                                                   g.device), 1),
                               total_mb=g.total_mb) for g in pool.gpus],
        ),
        cluster=cluster,
    )


def summary_line(pool: Pool, clients: int) -> str:
    """One line for systemd's STATUS= (`systemctl status`): what is loaded and waiting."""
    loaded = [m for m in pool.models.values() if m.has_ready_worker()]
    workers = sum(len(m.live_workers()) for m in pool.models.values())
    queued = sum(len(m.queue) for m in pool.models.values())
    running = sum(m.running() for m in pool.models.values())
    state = "stopping: " if pool.shutting_down else ""
    return (f"{state}{len(loaded)} model(s) loaded, {workers} worker(s), {queued} queued, "
            f"{running} running, {clients} client(s)")


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
            threads=w.threads_in_use or None,
            replacing=w.outdated,
            late=w.late,
            **_generation(w, now),
            info=w.info,
        )
        for w in model.processes()
    ]
    generating = [w for w in model.workers.values() if w.tokens.total]
    queued, running = _by_priority(model)
    priorities = model.metrics.snapshot(queued, running)
    return ModelStatus(
        key=model.spec.key, capability=model.spec.capability, state=model.state_name(),
        queued=len(model.queue), running=model.running(),
        completed=sum(p.completed for p in priorities),
        failed=sum(p.failed + p.expired for p in priorities), workers=workers,
        last_error=model.failures.last_error,
        memory_mb=round(model.charge().charged_mb, 1),
        health=model.health(now, pool.pool_config.heartbeat_timeout_s),
        priorities=priorities, mean_batch=round(model.metrics.mean_batch, 2),
        device=model.device, totals=model.metrics.totals(), loading=_loading(model),
        tokens_per_s=(round(sum(w.tokens.per_s(now) for w in generating), 1)
                      if generating else None),
        tokens=sum(w.tokens.total for w in generating),
        export_waits_for_mb=pool.exports.waits_for_memory(model),
        exporting=pool.exports.making(model),
        recommended=model.recommended,
    )


def _generation(worker: WorkerHandle, now: float) -> dict[str, Any]:
    """A generation worker's sequences (when it batches streams) and tokens/s."""
    fields: dict[str, Any] = {}
    max_sequences = worker.info.get("max_active_sequences")
    if isinstance(max_sequences, int):
        fields["sequences"], fields["max_sequences"] = len(worker.jobs), max_sequences
    if worker.tokens.total:
        fields["tokens_per_s"] = round(worker.tokens.per_s(now), 1)
    return fields


def _loading(model: ModelState) -> str | None:
    """What a loading model is doing: fetching its hub files (how much is in the cache
    so far), or reading its weights."""
    if not any(w.state in LOADING for w in model.processes()):
        return None
    repo = model.spec.repo
    if repo and (sources.cached_snapshot(repo, model.spec.revision) is None
                 or sources.partial_downloads(repo)):
        return f"downloading: {sources.download_progress_mb(repo):.1f} MiB in the cache so far"
    return "loading weights"


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
                  state=m.state_name(),
                  context=next((limit for w in m.workers.values()
                                if w.ready and (limit := token_limit(w.info))), None))
        for m in pool.models.values() if not m.retiring  # a reload removed it
    ]


@functools.cache  # it scans the installed distributions: far too slow for every status
def version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelpool")
    except PackageNotFoundError:
        return "0+unknown"
