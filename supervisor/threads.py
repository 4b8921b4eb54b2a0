"""Adaptive intra-op threads: a CPU worker's batch may use the cores that its idle
siblings (of every model) leave free.

A worker is started with `threads` (cpus / cold_start_workers by default), which is
what it uses when every worker is busy. When the others are idle, a lone request would
run on one core while the rest idle: each batch sent to a worker of a batched model
with automatic threads says how many threads it may use instead, the cores not granted
to busy workers (at least its own share). At 64 in flight every worker is busy and
each keeps its share; one request at a time gets every core.
"""

from __future__ import annotations

from collections.abc import Mapping

from modelpool.supervisor.models import ModelState
from modelpool.supervisor.workers import WorkerHandle


class ThreadBudget:
    def __init__(self, cpus: int, models: Mapping[str, ModelState]) -> None:
        self.cpus = cpus
        self.models = models

    def grant(self, model: ModelState, worker: WorkerHandle) -> int:
        """Threads for the batch about to go to `worker` (which is not busy yet); 0 for
        a model whose thread count stays as configured."""
        if not self.adaptive(model):
            worker.threads = 0
            return 0
        share = model.settings.threads
        worker.threads = max(share, self.cpus - self.busy_threads(worker))
        return worker.threads

    def adaptive(self, model: ModelState) -> bool:
        """Batched CPU models whose threads were not set by hand. Generation (a forward
        pass per token) keeps its share: it is not measured here."""
        return (model.device == "cpu" and model.spec.batched and not model.spec.threads
                and model.settings.threads_auto)

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
