"""What a capability adapter may do with its worker: send replies, mark progress, see aborts."""

from __future__ import annotations

from typing import Protocol

import msgspec
from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Error
from modelpool.protocol.pipes import WorkItem


class Outbox(Protocol):
    def send(self, msg: msgspec.Struct) -> None:
        """Send one reply up the work pipe."""

    def tick(self) -> None:
        """Advance the progress counter the heartbeat reports (per batch, token, step)."""

    def aborted(self, job_id: int) -> bool:
        """True once the supervisor asked to stop this job (cancel, timeout, shutdown)."""

    def image(self, item: WorkItem, index: int) -> Image.Image:
        """The item's index-th image, fetched and decoded under the image policy; raises
        PoolError (BAD_REQUEST, IMAGE_TOO_LARGE, URL_NOT_ALLOWED) for bad input."""


def error_reply(job_id: int, exc: BaseException) -> Error:
    """A typed error for a request that failed inside the model; the worker lives on."""
    if isinstance(exc, PoolError):
        return Error(id=job_id, code=exc.code, message=exc.message)
    return Error(id=job_id, code=ErrorCode.MODEL_ERROR, message=f"{type(exc).__name__}: {exc}")
