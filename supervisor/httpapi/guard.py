"""Each HTTP connection's guard, inside uvicorn's own protocol (httptools).

uvicorn times out only a kept-alive connection that has gone idle, and any byte that
arrives stops that clock; a fresh connection has no clock at all. So a client that
connects and sends its request line and headers slowly, or never, held its connection
for good, and max_clients of them (uvicorn's limit_concurrency counting connections)
had every other client answered 503 for good: slowloris. httptools also keeps a URL or
a header however long it grows. Here, on every connection:

- a request's line and headers must arrive within `header_timeout_s` of the connection,
  or of the previous answer on a kept-alive one: else 408 (if it began) and closed;
- they may take MAX_HEAD_BYTES at most (give or take one read), pipelined behind a
  request being answered too: else 431 and closed;
- past max_clients connections, the one that has waited longest for its next request
  (idle, or slow to send it) is closed to make room for the newcomer; only if every
  other is busy with a request is the newcomer answered 503 (with Retry-After) and
  closed. The others are served as before.

At a stop (the daemon's, or a reload's new front door taking over the address), uvicorn
closes at once every connection whose request has not begun to be answered, and so
loses the request of a client that connected just before: its connection was accepted,
its request not yet read. Here a connection that has not sent a request yet gets
REQUEST_GRACE_S to send it, and one whose request is arriving gets its header deadline;
either is answered, then closed. A kept-alive connection idle after an answer is closed
at once, as uvicorn does.

The body has its own bound (`read_body`, body_timeout_s), and a request being answered
none: the pool's timeouts bound that.

The guard also tells the app when its client has gone (`Departure`, in the scope's
extensions), so that a request's own task is cancelled then: watching ASGI's `receive`
for the disconnect takes a task of its own per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from modelpool.supervisor.httpapi.replies import error_body

MAX_HEAD_BYTES = 64 * 1024
REQUEST_GRACE_S = 1.0  # for a request whose connection was made before a stop
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


def error_answer(status: int, message: str,
                 code: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and body of an answer in OpenAI's error shape that closes the connection."""
    body = error_body(status, message, code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    return headers, body


def raw_error(status: int, message: str, code: str) -> bytes:
    """The same, whole, for a connection whose request never came to the app."""
    headers, body = error_answer(status, message, code)
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (status, REASONS[status]),
                     *(name + b": " + value + b"\r\n" for name, value in headers),
                     b"\r\n", body])


TOO_MANY = error_answer(503, "too many HTTP connections, each busy with a request "
                        "([http] max_clients); try again", "too_many_connections")
HEAD_TOO_LARGE = raw_error(431, f"request line and headers over {MAX_HEAD_BYTES} bytes",
                           "request_header_too_large")


class Departure:
    """A connection's client going away: the callbacks watching it are called once."""

    EXTENSION = "modelpool.departure"

    def __init__(self) -> None:
        self.gone = False
        self._watchers: list[Callable[[], object]] = []

    def watch(self, callback: Callable[[], object]) -> None:
        self._watchers.append(callback)

    def unwatch(self, callback: Callable[[], object]) -> None:
        if callback in self._watchers:
            self._watchers.remove(callback)

    def happened(self) -> None:
        self.gone = True
        watchers, self._watchers = self._watchers, []
        for callback in watchers:
            callback()


def departure_of(scope: Mapping[str, Any]) -> Departure:
    departure: Departure = scope["extensions"][Departure.EXTENSION]
    return departure


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guards above; `guarded()` sets the bounds."""

    header_timeout_s = 30.0
    max_clients = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting_since: float | None = None  # for a request, since then
        self.deadline: asyncio.TimerHandle | None = None
        self.in_head = False  # between a request's first byte and its headers' end
        self.head_bytes = 0
        self.departure = Departure()
        self.stopping = False

    # ---- waiting for a request's line and headers -------------------------------------

    def await_request(self) -> None:
        self.disarm()
        self.waiting_since = time.monotonic()
        self.deadline = self.loop.call_later(self.header_timeout_s, self.expire)

    def disarm(self) -> None:
        self.waiting_since = None
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def expire(self) -> None:
        """Its request did not come in time, or its place is wanted."""
        self.disarm()
        if self.transport.is_closing():
            return
        if self.in_head:
            self.transport.write(raw_error(
                408, f"the request line and headers did not arrive within "
                f"{self.header_timeout_s:g}s", "request_timeout"))
        self.transport.close()

    # ---- uvicorn's protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.await_request()
        if len(self.connections) > self.max_clients:
            self.make_room()

    def make_room(self) -> None:
        """Close the connection waiting longest for its request; if none is, this one
        is over the cap: its first request is answered 503."""
        live = [c for c in self.connections if not c.transport.is_closing()]
        if len(live) <= self.max_clients:
            return  # the others over the count are closing already
        waiting = [c for c in live if isinstance(c, GuardedProtocol) and c is not self
                   and c.waiting_since is not None]
        if waiting:
            min(waiting, key=lambda c: c.waiting_since or 0.0).expire()
        else:
            self.app = too_many_connections

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)
        self.departure.happened()

    def data_received(self, data: bytes) -> None:
        """A head is counted even while the request before it is answered (pipelined):
        httptools would keep all of it meanwhile."""
        if self.in_head:
            self.head_bytes += len(data)
        super().data_received(data)
        if self.in_head and self.head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            if self.waiting_since is not None:  # else an answer is being written
                self.transport.write(HEAD_TOO_LARGE)
            self.disarm()
            self.transport.close()

    def on_message_begin(self) -> None:
        """Counted from the next read on (the one that began it goes uncounted: what
        it held before may be the rest of a body its app did not read)."""
        super().on_message_begin()
        self.scope["extensions"] = {Departure.EXTENSION: self.departure}  # type: ignore[typeddict-unknown-key]
        self.in_head, self.head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self.disarm()
        self.in_head = False
        super().on_headers_complete()
        if self.stopping:
            self.cycle.keep_alive = False  # answered, then closed

    def shutdown(self) -> None:
        self.stopping = True
        if self.in_head:  # its request is arriving, bounded by its header deadline
            return
        if self.cycle is None and not self.transport.is_closing():
            self.disarm()  # made just before the stop: its request is on its way
            self.deadline = self.loop.call_later(REQUEST_GRACE_S, self.expire)
            return
        super().shutdown()

    def on_response_complete(self) -> None:
        idle_next = not self.pipeline  # else the next request, whole already, starts now
        super().on_response_complete()
        if idle_next and not self.transport.is_closing():
            self.await_request()


async def too_many_connections(scope: Scope, receive: ASGIReceiveCallable,
                               send: ASGISendCallable) -> None:
    """The app of a connection over max_clients: 503, and closed."""
    headers, body = TOO_MANY
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def guarded(header_timeout_s: float, max_clients: int) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's Config(http=...), with these bounds."""
    return type("GuardedProtocol", (GuardedProtocol,), {
        "header_timeout_s": header_timeout_s, "max_clients": max_clients})
