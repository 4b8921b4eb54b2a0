"""Adaptive intra-op threads: a CPU worker's batch may use the cores that its idle
siblings (of every model) leave free.

A worker is started with `threads` (cpus / cold_start_workers by default), which is
what it uses when every worker is busy. When the others are idle, a lone request would
run on one core while the rest idle: each batch sent to a worker of a batched or
streaming model with automatic threads says how many threads it may use instead, the
cores not granted to busy workers (at least its own share). At 64 in flight every
worker is busy and each keeps its share; one request at a time gets every core.

A batch ends within a forward pass or a few, but streams run for seconds while other
workers start and finish: whenever a worker starts or stops running work, the workers
running streams are granted again (`regrant`), and told when their count changes, so
that they give back the cores others now use and take them again once they are free.
"""

from __future__ import annotations

from collections.abc import Mapping

from modelpool.supervisor.models import ModelState
from modelpool.supervisor.workers import WorkerHandle


class ThreadBudget:
    def __init__(self, cpus: int, models: Mapping[str, ModelState]) -> None:
        self.cpus = cpus
        self.models = models
        self.streaming: list[ModelState] = []
        self.follow_models()

    def follow_models(self) -> None:
        """Whose streams are granted again as others start and stop: the models, their
        devices and their threads settings, at start and after each reload."""
        self.streaming = [m for m in self.models.values()
                          if m.spec.streaming and self.adaptive(m)]

    def grant(self, model: ModelState, worker: WorkerHandle, siblings_take_more: bool = False
              ) -> int:
        """Threads for the work about to go to `worker` (its own not counted); 0 for
        a model whose thread count stays as configured. `siblings_take_more`: other
        workers of the model are about to take more of its queue (a request split into
        parts, say), so their cores are not free: the work gets its share only. Granted
        both cores, the first part's worker ran beside the second's on three threads."""
        if not self.adaptive(model):
            worker.threads = 0
            return 0
        share = model.settings.threads
        free = 0 if siblings_take_more else self.cpus - self.busy_threads(worker)
        worker.threads = max(share, free)
        return worker.threads

    def regrant(self, changed: WorkerHandle) -> list[WorkerHandle]:
        """`changed` started or stopped running work: the other workers running streams
        of adaptive models, granted again; those whose count changed (worker.threads is
        the new one), to be told."""
        told = []
        for model in self.streaming:
            for worker in model.workers.values():
                if worker is changed or not worker.jobs:
                    continue
                threads = max(model.settings.threads, self.cpus - self.busy_threads(worker))
                if threads != worker.threads:
                    worker.threads = threads
                    told.append(worker)
        return told

    def adaptive(self, model: ModelState) -> bool:
        """Batched and streaming CPU models whose threads were not set by hand: both
        gain from every core (a lone text to embed; a lone stream of a ~100M-parameter
        causal LM decoded 1.6x faster on 2 threads than on 1, as did 16 in one worker)."""
        return (model.device == "cpu" and (model.spec.batched or model.spec.streaming)
                and not model.spec.threads and model.settings.threads_auto)

    def busy_threads(self, exclude: WorkerHandle) -> int:
        """Threads of the workers running something now (a worker that has replied and
        not yet asked for more is still BUSY, but its cores are free)."""
        busy = 0
        for model in self.models.values():
            if model.device != "cpu":
                continue
            for w in model.workers.values():
                if w is not exclude and w.jobs:
                    busy += w.threads or model.settings.threads
        return busy
