"""One model's state in the pool, and the answers only it can give: its settings, its
queue, its workers, whether it is failing to load, what it is charged in memory.

Owned by the Pool, which alone calls the methods that change it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from modelpool.protocol.fields import RequestDefaults
from modelpool.protocol.kinds import CAPABILITIES
from modelpool.protocol.pipes import ImagePolicy, Ready, SharedWeights, WorkerSettings
from modelpool.registry.model_files import recommended_sampling
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import memory, scaling
from modelpool.supervisor.affinity import Affinity
from modelpool.supervisor.ageing import Ageing
from modelpool.supervisor.config import PoolConfig
from modelpool.supervisor.metrics import ModelMetrics
from modelpool.supervisor.queueing import Job, JobQueue, JobState
from modelpool.supervisor.shm import weights_segment
from modelpool.supervisor.workers import WorkerHandle, WorkerState

LOADING = (WorkerState.STARTING, WorkerState.LOADING)
log = logging.getLogger("modelpool.pool")


@dataclass(frozen=True)
class ModelSettings:
    """The model's knobs: its spec's overrides, else the pool's values. Resolved once."""

    max_batch: int
    max_queue: int
    timeout_s: float
    stall_timeout_s: float
    threads: int  # per worker
    max_workers: int
    max_load_failures: int
    load_backoff_s: float
    load_backoff_max_s: float
    threads_auto: bool = True  # threads from the CPU count, not set in the config

    @classmethod
    def of(cls, spec: ModelSpec, pool: PoolConfig, cpus: int) -> ModelSettings:
        threads, max_workers = scaling.cpu_plan(
            cpus, pool.cold_start_workers, spec.threads or pool.threads_per_worker,
            spec.max_workers or pool.max_workers_per_model)
        return cls(max_batch=spec.max_batch or pool.max_batch,
                   max_queue=spec.max_queue or pool.max_queue,
                   timeout_s=spec.timeout_s or pool.timeout_s,
                   stall_timeout_s=spec.stall_timeout_s or pool.stall_timeout_s,
                   threads=threads, max_workers=max_workers,
                   max_load_failures=pool.max_load_failures,
                   load_backoff_s=pool.load_backoff_s, load_backoff_max_s=pool.load_backoff_max_s,
                   threads_auto=not (spec.threads or pool.threads_per_worker))


_GONE = (WorkerState.STOPPING, WorkerState.DEAD)  # a worker that will serve no more


@dataclass
class LoadFailures:
    """Failed loads in a row, and the back-off before the next attempt."""

    count: int = 0
    blocked_until: float = 0.0
    last_error: str | None = None
    last_at: float | None = None


@dataclass(eq=False)
class ModelState:
    spec: ModelSpec
    settings: ModelSettings
    device: str | None  # "cpu" or "cuda:N"; None: this machine lacks the asked one
    queue: JobQueue = field(default_factory=JobQueue)
    ageing: Ageing = field(default_factory=Ageing)  # of its queue's priority levels
    workers: dict[int, WorkerHandle] = field(default_factory=dict)
    holder: WorkerHandle | None = None  # the weights holder, when the model uses one
    shared_weights: SharedWeights | None = None  # what the holder shares once loaded
    metrics: ModelMetrics = field(default_factory=ModelMetrics)
    failures: LoadFailures = field(default_factory=LoadFailures)  # its loader failed
    deaths: LoadFailures = field(default_factory=LoadFailures)  # workers died before Ready
    last_active: float = 0.0  # last arrival or completion of a request
    last_scale_down: float = 0.0
    measured_weights_mb: float | None = None  # file-backed weights, reported at Ready
    measured_per_worker_mb: float | None = None  # largest private memory (USS) seen
    waiting_for_memory: bool = False
    # execution = "onnx" and no export cached: no worker starts until the daemon has made
    # it within the budget (exports.py); this is its expected peak, None otherwise.
    awaits_export_mb: float | None = None
    warm_target: int = 0  # workers kept up without traffic, set by `modelpool load`
    batch_timer: asyncio.TimerHandle | None = None
    batch_waited: bool = False
    affinity: Affinity = field(default_factory=Affinity)  # where like requests went last
    # A reload removed it: it serves what it has, then its workers stop (reload.py).
    retiring: bool = False
    # What its generation_config.json recommends for a request's unset sampling fields,
    # and the daemon's defaults with those in place, with what they were made of.
    recommended: dict[str, Any] = field(default_factory=dict)
    _defaults: tuple[RequestDefaults, dict[str, Any], RequestDefaults] | None = None

    @property
    def key(self) -> str:
        return self.spec.key

    # ---- questions -----------------------------------------------------------------

    @property
    def uses_holder(self) -> bool:
        setting = self.spec.weights_holder
        return setting == "on" or (setting == "auto" and (self.device or "").startswith("cuda"))

    def processes(self) -> list[WorkerHandle]:
        """Its serving workers and its weights holder."""
        return [*self.workers.values(), *([self.holder] if self.holder else [])]

    def live_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.state not in _GONE]

    def has_live_worker(self) -> bool:
        """A loop, not any() over a generator: this runs for every request, and the
        generator was ~1.5% of the supervisor's instructions per no-op request."""
        for worker in self.workers.values():  # noqa: SIM110
            if worker.state not in _GONE:
                return True
        return False

    def free_workers(self) -> list[WorkerHandle]:
        """Workers that asked for work and may get it: the least loaded first (a worker
        that batches streams asks for more while it runs some), then the most recently
        used, so the least recently used stay idle long enough to be retired."""
        free = [w for w in self.workers.values() if w.slots > 0 and not w.hung and not w.late
                and w.state in (WorkerState.IDLE, WorkerState.BUSY)]
        if len(free) > 1:
            free.sort(key=lambda w: (len(w.jobs), -w.last_used))
        return free

    def running(self) -> int:
        return sum(len(w.jobs) for w in self.workers.values())

    def has_ready_worker(self) -> bool:
        return any(w.ready for w in self.workers.values())

    @property
    def failed(self) -> bool:
        """Too many failed loads in a row: nothing starts until `modelpool load`."""
        return self.failures.count >= self.settings.max_load_failures

    def backing_off(self, now: float) -> bool:
        return now < self.failures.blocked_until and not self.has_live_worker()

    def state_name(self) -> str:
        if self.retiring:
            return "removing"
        if self.failed:
            return "failed"
        if self.has_ready_worker():
            return "ready"
        processes = self.processes()
        if any(w.state in LOADING for w in processes):
            return "loading"
        if processes:
            return "draining"
        if self.awaits_export_mb is not None:
            return "exporting"
        if len(self.queue):
            return "waiting-for-memory" if self.waiting_for_memory else "waiting"
        return "cold"

    def health(self, now: float, heartbeat_timeout_s: float) -> str:
        """"ok", or why not. Only models in use can be unhealthy: a cold one is fine."""
        if self.failed:
            return f"failed: {self.failures.last_error}"
        if now < self.failures.blocked_until and not self.has_ready_worker():
            return (f"load failing, retry in {self.failures.blocked_until - now:.1f}s: "
                    f"{self.failures.last_error}")
        for worker in self.workers.values():
            if worker.hung:
                return f"worker pid {worker.pid} hung ({worker.hung}), being replaced"
            if worker.last_heartbeat is not None and now - worker.last_heartbeat > \
                    heartbeat_timeout_s:
                return f"worker pid {worker.pid} silent for {now - worker.last_heartbeat:.1f}s"
        if self.waiting_for_memory and len(self.queue):
            return f"{self.key} waits for memory"
        return "ok"

    def charge(self) -> memory.ModelCharge:
        """What the model costs against the memory budget: measured once it is known."""
        weights, per_worker = self.measured_weights_mb, self.measured_per_worker_mb
        return memory.ModelCharge(
            weights_mb=self.spec.weights_mb if weights is None else weights,
            per_worker_mb=self.spec.per_worker_mb if per_worker is None else per_worker,
            workers=sum(w.state is not WorkerState.DEAD for w in self.workers.values()),
            shared_weights=self.device == "cpu" or self.uses_holder,
            held=self.holder is not None)

    def wait_cause(self, job: Job) -> str:
        """Why a job of this model has not finished yet, for TIMEOUT and DEADLINE_EXPIRED."""
        if job.parts:
            return f"split into {len(job.parts)} parts, {len(job.part_replies or ())} done"
        if job.state is JobState.RUNNING:
            worker = self.workers.get(job.worker_id or 0)
            return f"running on worker pid {worker.pid if worker else '?'}"
        if not self.workers and self.deaths.count:
            return f"its workers died while loading: {self.deaths.last_error}"
        if not self.workers and self.awaits_export_mb is not None:
            return "waiting for its ONNX export (execution = \"onnx\"), made before its workers"
        if not self.workers:
            return "waiting for memory" if self.waiting_for_memory else "waiting for a worker"
        if not self.has_ready_worker():
            return "the model was still loading"
        return f"waiting in a queue of {len(self.queue)}"

    def active_jobs(self) -> list[Job]:
        """Its jobs still owed a final reply: queued, and held by its workers."""
        held = [j for w in self.workers.values() for j in w.jobs.values()
                if j.state is not JobState.DONE]
        return [*self.queue.jobs(), *held]

    def worker_settings(self, worker_id: int, holder: bool, pool: PoolConfig,
                        images: ImagePolicy) -> WorkerSettings:
        """What a new worker (or weights holder) of this model is told."""
        return WorkerSettings(
            worker_id=worker_id,
            spec=msgspec.structs.replace(self.spec, device=self.device or "cpu"),
            threads=self.settings.threads, max_batch=self.settings.max_batch,
            heartbeat_interval_s=pool.heartbeat_interval_s, idle_load_s=pool.idle_load_s,
            images=images,
            hold_segment=weights_segment(worker_id) if holder else None,
            weights=None if holder else self.shared_weights)

    # ---- changes -------------------------------------------------------------------

    def request_defaults(self, daemon: RequestDefaults) -> RequestDefaults:
        """What a request for this model gets for a field it leaves unset: what the model
        recommends, else the daemon's default."""
        recommended = self.recommended
        if not recommended:
            return daemon
        made = self._defaults
        if made is None or made[0] is not daemon or made[1] is not recommended:
            made = self._defaults = (daemon, recommended,
                                     msgspec.structs.replace(daemon, **recommended))
        return made[2]

    def read_recommended(self) -> None:
        """Its generation_config.json's sampling, read (again: a hub model's files may
        have come since a worker downloaded them)."""
        sampled = self.spec.generation_config and CAPABILITIES[self.spec.capability].sampled
        recommended = recommended_sampling(self.spec) if sampled else {}
        if recommended != self.recommended:
            self.recommended = recommended
            if recommended:
                log.info("model %s: its generation_config.json recommends %s for requests "
                         "that leave them unset", self.key,
                         ", ".join(f"{k} {v}" for k, v in recommended.items()))

    def note_ready(self, worker: WorkerHandle, msg: Ready, now: float) -> None:
        worker.info, worker.load_s = msg.info, round(msg.load_s, 3)
        worker.last_used = worker.ready_at = now
        self.failures, self.deaths = LoadFailures(), LoadFailures()
        self.metrics.loads += 1
        if worker is self.holder:
            worker.uss_mb = msg.uss_mb
            self.shared_weights = msg.weights
            self.measured_weights_mb = msg.vram_mb if msg.vram_mb is not None else msg.weights_mb
            return
        if msg.weights_mb is not None:
            self.measured_weights_mb = msg.weights_mb
        self.read_recommended()
        self.note_uss(worker, msg.uss_mb)
        self.note_vram(msg.vram_mb)

    def note_uss(self, worker: WorkerHandle, uss_mb: float | None) -> None:
        """A worker's measured private memory replaces the registry's estimate."""
        if uss_mb is None:
            return
        worker.uss_mb = uss_mb
        if self.device == "cpu":  # a GPU worker is charged its VRAM, see note_vram
            self.measured_per_worker_mb = max(self.measured_per_worker_mb or 0.0, uss_mb)

    def note_vram(self, vram_mb: float | None) -> None:
        """A GPU worker's reserved VRAM replaces the per-worker estimate. Without a weights
        holder that includes its own copy of the weights, so they are not charged apart."""
        if vram_mb is None or self.device == "cpu":
            return
        if not self.uses_holder:
            self.measured_weights_mb = 0.0
        self.measured_per_worker_mb = max(self.measured_per_worker_mb or 0.0, vram_mb)

    def note_holder_measured(self, uss_mb: float | None, vram_mb: float | None) -> None:
        """The holder's own memory; the weights it holds (VRAM on a GPU) are the model's."""
        assert self.holder is not None
        if uss_mb is not None:
            self.holder.uss_mb = uss_mb
        if vram_mb is not None:
            self.measured_weights_mb = vram_mb

    def pin(self, workers: int, now: float) -> None:
        """`modelpool load`: keep this many workers up until unpinned, and try loading
        again even if it had failed."""
        self.clear_failures()
        self.warm_target = min(workers, self.settings.max_workers)
        self.last_active = now

    def unpin(self) -> None:
        self.warm_target = 0

    def note_load_failure(self, started_at: float, cause: str, now: float) -> None:
        """The loader failed: counts towards `failed`, and backs off."""
        self.metrics.load_failures += 1
        self._note(self.failures, started_at, cause, now)

    def note_death(self, started_at: float, cause: str, now: float) -> None:
        """A worker died before Ready, its loader blameless (a signal, the OOM killer, no
        file descriptors to start it): another start after a back-off; never `failed`."""
        self._note(self.deaths, started_at, cause, now)

    def _note(self, record: LoadFailures, started_at: float, cause: str, now: float) -> None:
        # Workers started together fail together: one attempt, one failure, one back-off
        # (doubling up to its cap).
        if record.last_at is None or started_at > record.last_at:
            record.last_at = now
            record.count += 1
            backoff = self.settings.load_backoff_s * 2 ** (record.count - 1)
            record.blocked_until = now + min(backoff, self.settings.load_backoff_max_s)
        record.last_error = cause

    def clear_failures(self) -> None:
        self.failures, self.deaths = LoadFailures(), LoadFailures()
