"""What a capability adapter may do with its worker: send replies, mark progress, see aborts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Error
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities.images import OpenedImage


class Outbox(Protocol):
    def send(self, msg: msgspec.Struct) -> None:
        """Send one reply up the work pipe."""

    def tick(self, tokens: int = 0) -> None:
        """Advance the progress counter the heartbeat reports (per batch, token, step),
        counting the tokens generated since the last tick."""

    def aborted(self, job_id: int) -> bool:
        """True once the supervisor asked to stop this job (cancel, timeout, shutdown)."""

    def opened_images(self, item: WorkItem) -> list[OpenedImage]:
        """The item's images, fetched, with their headers read and checked under the
        image policy (each, and in all), to be decoded when used; raises PoolError
        (BAD_REQUEST, IMAGE_TOO_LARGE, URL_NOT_ALLOWED) for bad input."""


@dataclass(frozen=True)
class Answered:
    """What a capability's prepare gives for a request that needs no sequence of the
    model's decoder (tokenize): its final reply."""

    reply: msgspec.Struct


def error_reply(job_id: int, exc: BaseException) -> Error:
    """A typed error for a request that failed inside the model; the worker lives on."""
    if isinstance(exc, PoolError):
        return Error(id=job_id, code=exc.code, message=exc.message)
    return Error(id=job_id, code=ErrorCode.MODEL_ERROR, message=f"{type(exc).__name__}: {exc}")
