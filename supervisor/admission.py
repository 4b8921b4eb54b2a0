"""Admission checks that refuse a request before it is queued: each returns None or the
(code, message) to answer with. Called by the Pool on its event loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Describe, EmbedImage, WorkRequest
from modelpool.supervisor import memory
from modelpool.supervisor.config import Config

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelState, Pool

Rejection = tuple[ErrorCode, str]


def image_error(config: Config, request: WorkRequest) -> Rejection | None:
    """What can be refused without decoding: the worker checks the rest."""
    inputs = request.images if isinstance(request, EmbedImage) else (
        [request.image] if isinstance(request, Describe) else [])
    policy = config.images
    for image in inputs:
        if bool(image.data) == bool(image.url):
            return ErrorCode.BAD_REQUEST, "each image needs exactly one of data or url"
        if image.data and len(image.data) > policy.max_bytes:
            return (ErrorCode.IMAGE_TOO_LARGE,
                    f"image of {len(image.data)} bytes exceeds {policy.max_bytes}")
        if image.url and not policy.allow_urls:
            return (ErrorCode.URL_NOT_ALLOWED,
                    "image URLs are disabled (set [images] allow_urls = true)")
    return None

def bounds_error(pool: Pool, model: ModelState, nbytes: int) -> Rejection | None:
    limit = model.spec.max_queue or pool.pool_config.max_queue
    if len(model.queue) >= limit:
        return ErrorCode.QUEUE_FULL, f"model {model.spec.key!r} has {limit} requests waiting"
    total = queued_bytes = 0
    for other in pool.models.values():  # one pass: this runs for every request
        total += other.queue.live
        queued_bytes += other.queue.nbytes
    if total >= pool.pool_config.max_queued_total:
        return ErrorCode.OVERLOADED, f"the daemon has {total} requests waiting"
    if queued_bytes + nbytes > pool.pool_config.max_queued_bytes:
        return (ErrorCode.OVERLOADED, f"the daemon holds {queued_bytes >> 20} MiB of waiting "
                f"requests (max_queued_bytes)")
    return None

def retry_after(model: ModelState | None) -> float:
    """A hint: how long the work ahead should take to drain."""
    if model is None or not model.metrics.service_s:
        return 1.0
    workers = max(1, len(model.live_workers()))
    per_item = model.metrics.service_s / max(1.0, model.metrics.mean_batch)
    return round(min(60.0, max(0.05, len(model.queue) * per_item / workers)), 3)

def memory_error(pool: Pool, key: str) -> Rejection | None:
    model = pool.models[key]
    if model.workers:
        return None  # it fits: it is running
    charge = pool.capacity.charge(model)
    budget = pool.capacity.budget_for(model.device or "cpu")
    if not memory.never_fits(charge, budget):
        return None
    return (ErrorCode.INSUFFICIENT_MEMORY,
            f"model {key!r} needs ~{charge.weights_mb + charge.per_worker_mb:.0f} MiB "
            f"(weights {charge.weights_mb:.0f} + one worker {charge.per_worker_mb:.0f}); "
            f"the budget on {model.device} is {budget:.0f} MiB")


def load_error(pool: Pool, model: ModelState) -> Rejection | None:
    if model.device is None:
        return (ErrorCode.MODEL_LOAD_FAILED, f"model {model.spec.key!r} asks for device "
                f"{model.spec.device!r}; this machine has {len(pool.gpus)} GPU(s)")
    key, now = model.spec.key, pool.clock()
    if model.load_failures >= pool.pool_config.max_load_failures:
        return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} failed to load "
                f"{model.load_failures} times ({model.last_error}); "
                f"`modelpool load {key}` retries")
    if now < model.blocked_until and not model.live_workers():
        return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} failed to load "
                f"({model.last_error}); retrying in {model.blocked_until - now:.1f}s")
    return None
