"""Operations on the pool that are not about one request: `modelpool load` and `unload`."""

from __future__ import annotations

from modelpool.protocol.errors import ErrorCode
from modelpool.registry.sources import hub_offline
from modelpool.supervisor import memory
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.pool import Pool


class ControlError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _model(pool: Pool, name: str) -> ModelState:
    spec = pool.registry.resolve(name)
    if spec is None:
        raise ControlError(ErrorCode.UNKNOWN_MODEL, f"no model {name!r}")
    return pool.models[spec.key]


def load_model(pool: Pool, name: str, workers: int) -> str:
    """Keep `workers` workers up (clearing a failed state) until `unload`, so requests
    never wait for a load. They start as load slots and memory allow."""
    model = _model(pool, name)
    if model.device is None or memory.never_fits(model.charge(),
                                                 pool.capacity.budget_for(model.device)):
        raise ControlError(ErrorCode.INSUFFICIENT_MEMORY,
                           f"model {model.key!r} has no device or can never fit its memory "
                           f"budget")
    missing = None if model.live_workers() else pool.intake.missing_files(model.spec)
    if missing is not None and not (missing.downloadable and not hub_offline()):
        raise ControlError(ErrorCode.MODEL_LOAD_FAILED, missing.message)
    model.pin(workers, pool.scheduler.now())
    pool.reconcile(model)
    capped = "" if workers <= model.warm_target else f" ({cap_reason(pool, model, workers)})"
    first = ""  # what the workers wait for
    if missing:
        first = ("; downloading it into the Hugging Face cache first (`modelpool status` "
                 "shows the bytes)")
    if model.awaits_export_mb is not None:
        first += "; they start once its ONNX export is made (execution = \"onnx\")"
    return (f"{model.key}: keeping {model.warm_target} worker(s) up{capped}; "
            f"{len(model.live_workers())} live or starting{first}")


def cap_reason(pool: Pool, model: ModelState, asked: int) -> str:
    """Why `load --workers N` keeps fewer than N: which setting caps it."""
    cap = model.settings.max_workers
    if model.spec.max_workers:
        why = f"the model's max_workers = {cap}"
    elif pool.pool_config.max_workers_per_model:
        why = f"[pool] max_workers_per_model = {cap}"
    else:
        why = (f"{cap} worker(s) of {model.settings.threads} thread(s) keep the CPUs this "
               f"daemon may use busy; more would only contend (set max_workers_per_model "
               f"or the model's max_workers to allow more)")
    return f"asked for {asked}, capped at {cap}: {why}"


def unload_model(pool: Pool, name: str) -> str:
    """Stop every worker of the model once its current work is done."""
    model = _model(pool, name)
    model.unpin()
    live = model.live_workers()
    for worker in live:
        pool.stop_worker(worker)
    pool.retire_unneeded_holder(model)  # else it stops after the last worker exits
    return f"{model.key}: stopping {len(live)} worker(s)"
