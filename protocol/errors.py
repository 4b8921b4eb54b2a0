"""The only error vocabulary on the wire: one ErrorCode enum and the PoolError exception."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a request failed. Values travel on the wire; never rename one."""

    BAD_REQUEST = "BAD_REQUEST"  # malformed frame, bad field, input the model cannot take
    PROTOCOL_VERSION = "PROTOCOL_VERSION"  # client and daemon speak different versions
    UNKNOWN_MODEL = "UNKNOWN_MODEL"  # no model of that key or alias
    WRONG_CAPABILITY = "WRONG_CAPABILITY"  # model exists but does not do what was asked
    TIMEOUT = "TIMEOUT"  # no final reply within timeout_s
    DEADLINE_EXPIRED = "DEADLINE_EXPIRED"  # the client's deadline passed before completion
    QUEUE_FULL = "QUEUE_FULL"  # the model's queue is at its bound
    OVERLOADED = "OVERLOADED"  # the daemon-wide bound on waiting work is reached
    INSUFFICIENT_MEMORY = "INSUFFICIENT_MEMORY"  # the model can never fit the memory budget
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"  # the model's weights could not be loaded
    MODEL_ERROR = "MODEL_ERROR"  # the model raised while running this request
    WORKER_DIED = "WORKER_DIED"  # the worker running the request died (after one retry)
    CANCELLED = "CANCELLED"  # the client cancelled the request
    SHUTTING_DOWN = "SHUTTING_DOWN"  # the daemon is stopping
    IMAGE_TOO_LARGE = "IMAGE_TOO_LARGE"  # image bytes or pixels over the configured caps
    URL_NOT_ALLOWED = "URL_NOT_ALLOWED"  # image URL refused by the fetch policy
    UNAVAILABLE = "UNAVAILABLE"  # the client cannot reach the daemon, or lost it
    RESULT_NOT_FOUND = "RESULT_NOT_FOUND"  # no such job: unknown, expired, forgotten, not yours
    PERMISSION_DENIED = "PERMISSION_DENIED"  # the daemon's [access] policy refuses it
    INTERNAL = "INTERNAL"  # a bug in modelpool; the message says where


class PoolError(Exception):
    """An error reply from the daemon, or a failure of the client to reach it."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
