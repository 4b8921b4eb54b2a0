"""The Python client library: Client (blocking) and AsyncClient (asyncio).

    with Client() as c:
        v = c.embed("hello")                       # numpy float32, shape (384,)
        for chunk in c.generate("Once", model="tiny-llm", max_tokens=16):
            print(chunk.text, end="")              # the last chunk has .finish_reason

One connection multiplexes many requests; replies are matched by request id. A Client is
for one thread; an AsyncClient serves any number of tasks on its loop.

The request methods (embed, generate, embed_image, describe, generate_image, ...) are
made from the request-kind table (protocol/kinds.py), one per row, with that row's
builder's signature and docstring plus `priority`, `timeout_s` and `deadline_s`: a new
kind of request needs no code here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec

from modelpool.protocol.client_core import (
    Call,
    ImageChunk,
    TextChunk,
    TextResult,
    check_reply,
    encode_checked,
    is_final,
    is_last,
    job_result,
    make_call,
    merged,
    op_signature,
    split_call,
    submit_message,
    unavailable,
    undecodable,
)
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import MAX_FRAME_BYTES, read_frame, recv_frame, send_frame
from modelpool.protocol.framing import frame as make_frame
from modelpool.protocol.jobs import CancelJob, ForgetJob, GetStats, JobQuery, ListJobs, Retrieve
from modelpool.protocol.kinds import KINDS, Kind
from modelpool.protocol.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Error,
    GetStatus,
    Hello,
    ListModels,
    LoadModel,
    StopDaemon,
    UnloadModel,
    Welcome,
    encoder,
    to_builtins,
)
from modelpool.protocol.paths import default_socket_path
from modelpool.protocol.peers import Peer, check_daemon, trusted_daemon_uids
from modelpool.protocol.wire import server_decoder

__all__ = ["AsyncClient", "Client", "ErrorCode", "ImageChunk", "PoolError", "TextChunk",
           "TextResult"]


class Client:
    """Blocking client. Not thread-safe: use one per thread."""

    def __init__(self, socket_path: str | None = None, timeout_s: float | None = None,
                 name: str = "python", daemon_uid: int | str | None = None) -> None:
        """daemon_uid: a user (uid or name) whose daemon to trust besides your own and
        root's (default: $MODELPOOL_DAEMON_UID); any other daemon is refused."""
        self.socket_path = socket_path or default_socket_path()
        trusted = trusted_daemon_uids(daemon_uid)
        self._ids = itertools.count(1)
        self._inbox: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self._dropped: set[int] = set()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(self.socket_path)
        except OSError as exc:
            self._sock.close()
            raise unavailable(self.socket_path, exc) from exc
        try:
            self.daemon: Peer = check_daemon(self._sock, self.socket_path, trusted)
            self._send(Hello(protocol_version=PROTOCOL_VERSION, client=name))
            self.welcome: Welcome = check_reply(self._recv())
        except BaseException:
            self._sock.close()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def _send(self, msg: msgspec.Struct) -> None:
        payload = encode_checked(msg, getattr(self, "welcome", None))
        try:
            send_frame(self._sock, payload)
        except OSError as exc:
            raise unavailable(self.socket_path, exc) from exc

    def _recv(self) -> Any:
        try:
            return server_decoder.decode(recv_frame(self._sock, MAX_FRAME_BYTES))
        except (OSError, EOFError) as exc:
            raise unavailable(self.socket_path, exc) from exc
        except msgspec.DecodeError as exc:
            raise undecodable(exc) from exc

    def _next(self, rid: int) -> Any:
        """The next reply for request rid; replies for other requests are kept for later."""
        if self._inbox[rid]:
            return self._inbox[rid].popleft()
        while True:
            msg = self._recv()
            mid = getattr(msg, "id", None)
            if mid == rid or mid is None:
                return msg
            if mid in self._dropped:
                if is_final(msg):
                    self._dropped.discard(mid)
                continue
            self._inbox[mid].append(msg)

    def _final(self, msg: Any) -> Any:
        self._send(msg)
        try:
            return self._next(msg.id)
        finally:
            self._inbox.pop(msg.id, None)

    def _request(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = make_call(op, next(self._ids), args, kwargs)
        if call.kind.streaming:
            self._send(call.request)
            return self._stream(call)
        parts = split_call(call, self._ids)
        if len(parts) == 1:
            return call.parse(self._final(call.request))
        return merged(call, self._all(parts))

    def _all(self, parts: list[Any]) -> list[Any]:
        """Send every part, then take their final replies in order. Once one fails, the
        replies of the parts after it are dropped as they come."""
        for part in parts:
            self._send(part)
        replies: list[Any] = []
        try:
            for part in parts:
                replies.append(self._next(part.id))
                if isinstance(replies[-1], Error):
                    break
        finally:
            for part in parts[len(replies):]:
                if not self._inbox.pop(part.id, None):
                    self._dropped.add(part.id)
        return replies

    def _stream(self, call: Call) -> Iterator[Any]:
        finished = False
        try:
            while not finished:
                chunk = call.parse(self._next(call.id))
                finished = is_last(chunk)
                yield chunk
        except PoolError:
            finished = True
            raise
        finally:
            self._inbox.pop(call.id, None)
            if not finished and self._sock.fileno() != -1:  # a closed client needs no cancel
                self._dropped.add(call.id)
                with contextlib.suppress(PoolError):
                    self._send(Cancel(id=call.id))

    def status(self) -> dict[str, Any]:
        return to_builtins(check_reply(self._final(GetStatus(id=next(self._ids)))).status)

    def models(self) -> list[dict[str, Any]]:
        return to_builtins(check_reply(self._final(ListModels(id=next(self._ids)))).models)

    def load(self, model: str, workers: int = 1) -> str:
        msg = LoadModel(id=next(self._ids), model=model, workers=workers)
        return check_reply(self._final(msg)).message

    def unload(self, model: str) -> str:
        return check_reply(self._final(UnloadModel(id=next(self._ids), model=model))).message

    def stop(self) -> str:
        return check_reply(self._final(StopDaemon(id=next(self._ids)))).message

    # ---- jobs: hand work over now, collect the result later, from any connection -------

    def submit(self, op: str, *args: Any, **kwargs: Any) -> str:
        """Submit `op` ("embed", "generate", ...) with that method's arguments; returns
        the job's key at once. The job runs even if this client goes away."""
        msg = submit_message(next(self._ids), op, args, kwargs)
        return str(check_reply(self._final(msg)).key)

    def retrieve(self, key: str, timeout_s: float = 30.0) -> Any:
        """What the direct call returns (an array; a TextResult for generate and
        describe; the final ImageChunk for generate_image), or PoolError with the job's
        code: TIMEOUT if not done within timeout_s (the job goes on), RESULT_NOT_FOUND."""
        waiting = self._sock.gettimeout()
        if waiting is not None:  # the reply may take timeout_s to come
            self._sock.settimeout(max(waiting, timeout_s + 5))
        try:
            reply = self._final(Retrieve(id=next(self._ids), key=key, timeout_s=timeout_s))
        finally:
            self._sock.settimeout(waiting)
        return job_result(check_reply(reply))

    def job(self, key: str) -> dict[str, Any]:
        """A job's state (queued, running, done, failed, cancelled) and times."""
        return to_builtins(check_reply(self._final(JobQuery(id=next(self._ids), key=key))).job)

    def cancel(self, key: str) -> None:
        check_reply(self._final(CancelJob(id=next(self._ids), key=key)))

    def forget(self, key: str) -> None:
        """Remove a job's result now rather than at the end of its retention."""
        check_reply(self._final(ForgetJob(id=next(self._ids), key=key)))

    def jobs(self, limit: int = 100) -> list[dict[str, Any]]:
        """This user's recent jobs, newest first."""
        msg = ListJobs(id=next(self._ids), limit=limit)
        return to_builtins(check_reply(self._final(msg)).jobs)

    def stats(self) -> dict[str, Any]:
        """Workers, active and queued jobs, memory used and budget, completed and failed."""
        return to_builtins(check_reply(self._final(GetStats(id=next(self._ids)))).stats)


class AsyncClient:
    """asyncio client; any number of tasks may share one connection."""

    def __init__(self, socket_path: str | None = None, name: str = "python-async",
                 daemon_uid: int | str | None = None) -> None:
        """daemon_uid: as for Client."""
        self.socket_path = socket_path or default_socket_path()
        self.name = name
        self._trusted = trusted_daemon_uids(daemon_uid)
        self.daemon: Peer | None = None
        self._ids = itertools.count(1)
        self._routes: dict[int, asyncio.Queue[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.welcome: Welcome | None = None

    async def connect(self) -> AsyncClient:
        try:
            reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise unavailable(self.socket_path, exc) from exc
        try:
            self.daemon = check_daemon(self._writer.get_extra_info("socket"), self.socket_path,
                                       self._trusted)
            self._writer.write(make_frame(encoder.encode(
                Hello(protocol_version=PROTOCOL_VERSION, client=self.name))))
            self.welcome = check_reply(server_decoder.decode(await read_frame(reader)))
        except BaseException:
            self._writer.close()
            self._writer = None
            raise
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        return self

    @property
    def connected(self) -> bool:
        """Connected, and the daemon has not closed the connection."""
        return self._reader_task is not None and not self._reader_task.done()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        lost: BaseException = ConnectionError("connection closed by the daemon")
        try:
            while True:
                msg = server_decoder.decode(await read_frame(reader))
                route = self._routes.get(getattr(msg, "id", None))  # type: ignore[arg-type]
                if route is not None:
                    route.put_nowait(msg)
                elif isinstance(msg, Error) and msg.id is None:
                    lost = PoolError(msg.code, msg.message)  # the daemon closes after these
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            lost = exc
        except msgspec.DecodeError as exc:
            lost = undecodable(exc)
        finally:
            err = unavailable(self.socket_path, lost)
            for route in self._routes.values():
                route.put_nowait(Error(id=None, code=err.code, message=err.message))

    def _open(self, msg: msgspec.Struct) -> asyncio.Queue[Any]:
        if self._writer is None:
            raise PoolError(ErrorCode.UNAVAILABLE, "AsyncClient is not connected")
        payload = encode_checked(msg, self.welcome)
        route: asyncio.Queue[Any] = asyncio.Queue()
        self._routes[msg.id] = route  # type: ignore[attr-defined]
        self._writer.write(make_frame(payload))
        return route

    async def _final(self, msg: Any) -> Any:
        route = self._open(msg)
        try:
            return await route.get()
        finally:
            self._routes.pop(msg.id, None)

    async def _request(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = make_call(op, next(self._ids), args, kwargs)
        parts = split_call(call, self._ids)
        try:
            replies = await asyncio.gather(*(self._final(part) for part in parts))
        except asyncio.CancelledError:
            for part in parts:
                self._cancel(part.id)  # the daemon stops work nobody awaits any more
            raise
        return call.parse(replies[0]) if len(parts) == 1 else merged(call, replies)

    def _cancel(self, rid: int) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(make_frame(encoder.encode(Cancel(id=rid))))

    async def _stream(self, op: str, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        call = make_call(op, next(self._ids), args, kwargs)
        route = self._open(call.request)
        finished = False
        try:
            while not finished:
                chunk = call.parse(await route.get())
                finished = is_last(chunk)
                yield chunk
        except PoolError:
            finished = True
            raise
        finally:
            self._routes.pop(call.id, None)
            if not finished:
                self._cancel(call.id)

    async def status(self) -> dict[str, Any]:
        return to_builtins(check_reply(await self._final(GetStatus(id=next(self._ids)))).status)

    async def models(self) -> list[dict[str, Any]]:
        msg = ListModels(id=next(self._ids))
        return to_builtins(check_reply(await self._final(msg)).models)

    async def load(self, model: str, workers: int = 1) -> str:
        msg = LoadModel(id=next(self._ids), model=model, workers=workers)
        return check_reply(await self._final(msg)).message

    async def unload(self, model: str) -> str:
        msg = UnloadModel(id=next(self._ids), model=model)
        return check_reply(await self._final(msg)).message

    async def stop(self) -> str:
        return check_reply(await self._final(StopDaemon(id=next(self._ids)))).message

    # ---- jobs: as Client's ------------------------------------------------------------

    async def submit(self, op: str, *args: Any, **kwargs: Any) -> str:
        msg = submit_message(next(self._ids), op, args, kwargs)
        return str(check_reply(await self._final(msg)).key)

    async def retrieve(self, key: str, timeout_s: float = 30.0) -> Any:
        msg = Retrieve(id=next(self._ids), key=key, timeout_s=timeout_s)
        return job_result(check_reply(await self._final(msg)))

    async def job(self, key: str) -> dict[str, Any]:
        msg = JobQuery(id=next(self._ids), key=key)
        return to_builtins(check_reply(await self._final(msg)).job)

    async def cancel(self, key: str) -> None:
        check_reply(await self._final(CancelJob(id=next(self._ids), key=key)))

    async def forget(self, key: str) -> None:
        check_reply(await self._final(ForgetJob(id=next(self._ids), key=key)))

    async def jobs(self, limit: int = 100) -> list[dict[str, Any]]:
        msg = ListJobs(id=next(self._ids), limit=limit)
        return to_builtins(check_reply(await self._final(msg)).jobs)

    async def stats(self) -> dict[str, Any]:
        return to_builtins(check_reply(await self._final(GetStats(id=next(self._ids)))).stats)


def _named(method: Callable[..., Any], kind: Kind, owner: type) -> Callable[..., Any]:
    method.__name__ = kind.op
    method.__qualname__ = f"{owner.__name__}.{kind.op}"
    method.__doc__ = kind.build.__doc__
    method.__signature__ = op_signature(kind)  # type: ignore[attr-defined]
    return method


def _sync_method(kind: Kind) -> Callable[..., Any]:
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        return self._request(kind.op, args, kwargs)

    return _named(method, kind, Client)


def _async_method(kind: Kind) -> Callable[..., Any]:
    if kind.streaming:
        def stream(self: AsyncClient, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return self._stream(kind.op, args, kwargs)

        return _named(stream, kind, AsyncClient)

    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        return await self._request(kind.op, args, kwargs)

    return _named(method, kind, AsyncClient)


for _kind in KINDS:
    setattr(Client, _kind.op, _sync_method(_kind))
    setattr(AsyncClient, _kind.op, _async_method(_kind))
