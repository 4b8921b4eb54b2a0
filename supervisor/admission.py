"""Admission checks that refuse a request before it is queued: pure functions of the
request and the state they are handed, each returning None or the (code, message) to
answer with."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.kinds import Kind
from modelpool.protocol.messages import WorkRequest
from modelpool.protocol.pipes import ImagePolicy
from modelpool.registry.spec import ModelSpec, Registry
from modelpool.supervisor import memory
from modelpool.supervisor.config import PoolConfig
from modelpool.supervisor.models import ModelState
from modelpool.supervisor.owners import Tenant, share_of, user_of

Rejection = tuple[ErrorCode, str]


class RemoteModel(msgspec.Struct, frozen=True):
    """A model this daemon's config does not name that another live node of its
    cluster can run: what a request for it is checked against here."""

    key: str
    capability: str
    variant: str | None = None  # of that node's config (cluster_view.variant_of)


def resolve(registry: Registry, kind: Kind, request: WorkRequest) -> ModelSpec | None:
    """The model the request names, or the default model of the kind's first capability."""
    if request.model:
        return registry.resolve(request.model)
    key = registry.defaults.get(kind.served_by[0])
    return registry.specs.get(key) if key else None


def deadline_in(request: WorkRequest, wall_now: float) -> float | None:
    """Seconds left of the client's deadline, counted from when the client sent it."""
    if request.deadline_s is None:
        return None
    in_transit = max(0.0, wall_now - request.sent_at) if request.sent_at else 0.0
    return request.deadline_s - in_transit


def request_error(kind: Kind, request: WorkRequest, spec: ModelSpec | RemoteModel | None,
                  images: ImagePolicy) -> Rejection | None:
    """Is there a model that does this, and is the request well formed?"""
    if spec is None:
        name = request.model or f"(default {kind.served_by[0]} model)"
        return ErrorCode.UNKNOWN_MODEL, f"no model {name!r}; see `modelpool models`"
    if spec.capability not in kind.served_by:
        return (ErrorCode.WRONG_CAPABILITY,
                f"model {spec.key!r} is {spec.capability}, not {kind.served_by[0]}")
    if (problem := kind.check(request)) is not None:
        return ErrorCode.BAD_REQUEST, problem
    if kind.with_images is None:  # the kinds that carry no images: most requests
        return None
    return image_error(kind, request, images)


def image_error(kind: Kind, request: WorkRequest, policy: ImagePolicy) -> Rejection | None:
    """What can be refused without decoding: the worker checks the rest."""
    for image in kind.images(request):
        if bool(image.data) == bool(image.url):
            return ErrorCode.BAD_REQUEST, "each image needs exactly one of data or url"
        if image.data and len(image.data) > policy.max_bytes:
            return (ErrorCode.IMAGE_TOO_LARGE,
                    f"image of {len(image.data)} bytes exceeds {policy.max_bytes}")
        if image.url and not policy.allow_urls:
            return (ErrorCode.URL_NOT_ALLOWED,
                    "image URLs are disabled (set [images] allow_urls = true)")
    return None


def load_error(model: ModelState, now: float, gpu_count: int) -> Rejection | None:
    """The model cannot be loaded now: no such device, failed, or backing off."""
    key, failures = model.key, model.failures
    if model.device is None:
        return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} asks for device "
                f"{model.spec.device!r}; this machine has {gpu_count} GPU(s)")
    if model.failed:
        return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} failed to load "
                f"{failures.count} times ({failures.last_error}); `modelpool load {key}` "
                f"retries")
    if model.backing_off(now):
        return (ErrorCode.MODEL_LOAD_FAILED, f"model {key!r} failed to load "
                f"({failures.last_error}); retrying in {failures.blocked_until - now:.1f}s")
    return None


def memory_error(model: ModelState, budget_for: Callable[[str], float]) -> Rejection | None:
    """The model can never fit, even alone (one that fits later waits its turn)."""
    if model.workers:
        return None  # it fits: it is running
    budget_mb = budget_for(model.device or "cpu")
    export_mb = model.awaits_export_mb
    if export_mb is not None and export_mb > budget_mb:
        return (ErrorCode.INSUFFICIENT_MEMORY,
                f"model {model.key!r} runs ONNX (execution = \"onnx\") and its export, made "
                f"before its first worker, peaks at ~{export_mb:.0f} MiB; the budget on "
                f"{model.device} is {budget_mb:.0f} MiB")
    charge = model.charge()
    if not memory.never_fits(charge, budget_mb):
        return None
    return (ErrorCode.INSUFFICIENT_MEMORY,
            f"model {model.key!r} needs ~{charge.weights_mb + charge.per_worker_mb:.0f} MiB "
            f"(weights {charge.weights_mb:.0f} + one worker {charge.per_worker_mb:.0f}); "
            f"the budget on {model.device} is {budget_mb:.0f} MiB")


def bounds_error(model: ModelState, nbytes: int, config: PoolConfig,
                 owner: Hashable = None) -> Rejection | None:
    """No queue is unbounded: per model in requests, in all in requests and bytes; and
    no one user (whatever its connections) takes the last quarter of a model's queue,
    which is kept for others, nor one tenant the last quarter of its user's share."""
    limit = model.settings.max_queue
    if len(model.queue) >= limit:
        return ErrorCode.QUEUE_FULL, f"model {model.key!r} has {limit} requests waiting"
    share = share_of(limit)
    if model.queue.held.get(user_of(owner), 0) >= share:
        return (ErrorCode.QUEUE_FULL, f"model {model.key!r}: {share} of this user's "
                "requests wait; the rest is kept for others")
    if isinstance(owner, Tenant):  # and the last quarter of its user's share, for its others
        share = share_of(share)
        if model.queue.held.get(owner, 0) >= share:
            return (ErrorCode.QUEUE_FULL, f"model {model.key!r}: {share} of this tenant's "
                    "requests wait; the rest is kept for others")
    totals = model.queue.totals  # every model's queue together
    if totals.live >= config.max_queued_total:
        return ErrorCode.OVERLOADED, f"the daemon has {totals.live} requests waiting"
    if totals.nbytes + nbytes > config.max_queued_bytes:
        return (ErrorCode.OVERLOADED, f"the daemon holds {totals.nbytes >> 20} MiB of "
                f"waiting requests (max_queued_bytes)")
    return None


def retry_after(model: ModelState | None) -> float:
    """A hint: how long the work ahead should take to drain."""
    if model is None or not model.metrics.service_s:
        return 1.0
    workers = max(1, len(model.live_workers()))
    per_item = model.metrics.service_s / max(1.0, model.metrics.mean_batch)
    return round(min(60.0, max(0.05, len(model.queue) * per_item / workers)), 3)
