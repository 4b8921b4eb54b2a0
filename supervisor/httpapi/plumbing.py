"""What every HTTP request goes through before and around the pool: its key, its body
(bounded in size and time), its options from headers, and its client going away."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.fields import PRIORITIES
from modelpool.protocol.kinds import BY_OP
from modelpool.supervisor.httpapi.guard import departure_of
from modelpool.supervisor.httpapi.replies import HttpError
from modelpool.supervisor.httpapi.settings import HttpSettings

T = TypeVar("T")
HEADER_OPTIONS = {"x-modelpool-priority": "priority", "x-modelpool-timeout": "timeout_s",
                  "x-modelpool-deadline": "deadline_s"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer."""


def check_key(request: Request, keys: list[str]) -> None:
    """Bearer keys compared in constant time; no keys configured: open (loopback only)."""
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HttpError(401, "missing API key: send Authorization: Bearer <key>",
                        "missing_api_key")
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
        raise HttpError(401, "invalid API key", "invalid_api_key")


def model_name(asked: str, settings: HttpSettings, op: str) -> str:
    """The model that answers: the one asked for, else the daemon's default for it."""
    return asked or settings.default_models.get(BY_OP[op].served_by[0], "")


def client_identity(request: Request) -> str:
    """Whose work this is, for fair shares: the key if there is one, else the address."""
    auth = request.headers.get("authorization")
    if auth:
        return auth
    return request.client.host if request.client else ""


async def read_body(request: Request, settings: HttpSettings) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > settings.max_body_bytes:
        raise _too_large(settings.max_body_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > settings.max_body_bytes:
                    raise _too_large(settings.max_body_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError(408, f"the request body did not arrive within "
                        f"{settings.body_timeout_s:g}s", "request_timeout") from None
    return b"".join(chunks)


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"request body over {limit} bytes", "request_too_large")


def decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise HttpError(400, text, "invalid_request", param) from None
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"the body is not valid JSON: {exc}", "invalid_json") from None


def with_header_options(request: Request, kwargs: dict[str, Any],
                        settings: HttpSettings) -> dict[str, Any]:
    """Options from X-Modelpool-* headers where the body set none; the priority cap; the
    HTTP client's own turn in the queues (its tenant) and, with keys, its cache salt."""
    # Each HTTP client (by key, else address) takes turns with the others whichever of
    # the front door's connections it shares: a connection's own requests go in order.
    out = {**kwargs, "tenant": hashlib.blake2b(client_identity(request).encode(),
                                               digest_size=16).hexdigest()}
    for header, name in HEADER_OPTIONS.items():
        value = request.headers.get(header)
        if value is None or name in out:
            continue
        if name == "priority":
            if value not in PRIORITIES:
                raise HttpError(400, f"{header}: one of {', '.join(PRIORITIES)}",
                                "invalid_request", header)
            out[name] = value
            continue
        try:
            out[name] = float(value)
        except ValueError:
            raise HttpError(400, f"{header}: seconds, a number", "invalid_request",
                            header) from None
        if not out[name] > 0:
            raise HttpError(400, f"{header}: must be > 0", "invalid_request", header)
    priority = out.get("priority", "normal")
    if PRIORITIES.index(priority) < PRIORITIES.index(settings.max_priority):
        raise PoolError(ErrorCode.PERMISSION_DENIED, f"priority {priority!r} is above this "
                        f"API's cap ({settings.max_priority!r}, [http] max_priority)")
    if "cache_salt" in out and settings.api_keys and settings.prefix_cache_per_key:
        out["cache_salt"] = key_salt(out["tenant"], out["cache_salt"])
    return out


def key_salt(tenant: str, salt: str) -> str:
    """The cache salt of a request of this HTTP client (its tenant, a hash of its key):
    clients of different keys take nothing from each other's kept prompts (whose time to
    first token and cached_tokens would tell one what another's prompts began with), and
    a key's own salts still keep its requests apart. No key reaches a worker, a log or
    the cluster's database; of fixed size, within the salt's cap whatever the client
    sent."""
    return hashlib.blake2b(f"{tenant}\0{salt}".encode(), digest_size=16).hexdigest()


async def unless_disconnected(scope: Scope, work: Coroutine[Any, Any, T]) -> T:
    """The work's result, awaited in the request's own task; if the client goes first,
    that task is cancelled (which cancels the work in the daemon too) and ClientGone
    raised."""
    departure = departure_of(scope)
    if departure.gone:
        work.close()
        raise ClientGone
    task = asyncio.current_task()
    assert task is not None
    departure.watch(task.cancel)
    try:
        return await work
    except asyncio.CancelledError:
        if not departure.gone:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        departure.unwatch(task.cancel)


class EventStream(Response):
    """Server-sent events, sent by the request's own task as they come; a disconnect
    cancels it, which closes the events' iterator and so the daemon's stream, cancelling
    its work. (Starlette's StreamingResponse starts every stream in an anyio task group,
    as uvicorn announces ASGI 2.3: 0.1 ms here before the first event could go out.)"""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.events):  # type: ignore[type-var]
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            with contextlib.suppress(ClientGone):
                await unless_disconnected(scope, self._send_all(send))

    async def _send_all(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
