"""AsyncClient: the asyncio client, any number of tasks sharing one connection.
Re-exported by protocol/client.py, beside the blocking Client."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import msgspec

from modelpool.protocol.client_core import (
    Call,
    TextChunk,
    check_reply,
    encode_checked,
    follow_call,
    is_last,
    job_result,
    make_call,
    merged,
    named_method,
    split_call,
    submit_message,
    unavailable,
    undecodable,
    unstreamed_call,
    whole_reply,
)
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import MAX_FRAME_BYTES, FrameReader, FrameTooLarge
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
    ReloadConfig,
    StopDaemon,
    UnloadModel,
    Welcome,
    encoder,
    to_builtins,
)
from modelpool.protocol.paths import default_socket_path
from modelpool.protocol.peers import Peer, check_daemon, trusted_daemon_uids
from modelpool.protocol.wire import server_decoder


class _Replies(asyncio.Protocol):
    """The connection's reading side: whole frames out of the bytes as they come, each
    handed to the client in the loop's callback (a readexactly per header and per body
    was a fifth of this client's time per no-op request at 64 in flight)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.frames = FrameReader()

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        while (payload := self.frames.next(MAX_FRAME_BYTES)) is not None:
            if isinstance(payload, int):
                self.client._lost(self.client._unreachable(
                    FrameTooLarge(payload, MAX_FRAME_BYTES)))
                return
            self.client._received(payload)
        self.frames.compact()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost(self.client._last_word or self.client._unreachable(
            exc or ConnectionError("connection closed by the daemon")))


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
        # Where each request's replies go: a future for the one final reply of most, a
        # queue for a stream's chunks. (A queue per request, and a task per request
        # from gather, were most of this client's cost per no-op request.)
        self._finals: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._transport: asyncio.Transport | None = None
        # Frames sent in one turn of the event loop leave in one write at its end (64
        # tasks sharing the connection made 64 sends where one does).
        self._unsent: list[bytes] = []
        self._welcomed: asyncio.Future[Any] | None = None  # the hello's answer, awaited
        self._gone: asyncio.Future[None] | None = None  # done when the connection is lost
        self._last_word: PoolError | None = None  # the daemon's, when it closes
        self._why_gone: PoolError | None = None
        self.welcome: Welcome | None = None

    async def connect(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        self._welcomed, self._gone = loop.create_future(), loop.create_future()
        self._last_word = self._why_gone = None
        try:
            transport, _ = await loop.create_unix_connection(lambda: _Replies(self),
                                                             self.socket_path)
        except OSError as exc:
            raise unavailable(self.socket_path, exc) from exc
        self._transport = cast(asyncio.Transport, transport)
        try:
            self.daemon = check_daemon(transport.get_extra_info("socket"), self.socket_path,
                                       self._trusted)
            self._write(make_frame(encoder.encode(
                Hello(protocol_version=PROTOCOL_VERSION, client=self.name))))
            self.welcome = check_reply(await self._welcomed)
        except BaseException:
            transport.close()
            raise
        return self

    @property
    def connected(self) -> bool:
        """Connected, and the daemon has not closed the connection."""
        return self._gone is not None and self.welcome is not None and not self._gone.done()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._transport is None or self._gone is None:
            return
        self._flush()  # what was asked before closing still goes
        self._transport.close()
        await asyncio.shield(self._gone)

    # ---- the connection's callbacks (from _Replies) ------------------------------------

    def _received(self, payload: bytes | bytearray) -> None:
        try:
            msg = server_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            self._lost(undecodable(exc))
            return
        if self._welcomed is not None and not self._welcomed.done():
            self._welcomed.set_result(msg)
            return
        rid = getattr(msg, "id", None)
        final = self._finals.pop(rid, None)  # type: ignore[arg-type]
        if final is not None:
            if not final.done():  # else its awaiter was cancelled
                final.set_result(msg)
        elif (stream := self._streams.get(rid)) is not None:  # type: ignore[arg-type]
            stream.put_nowait(msg)
        elif isinstance(msg, Error) and msg.id is None:
            # the daemon closes after most of these: then they say why it went
            self._last_word = PoolError(msg.code, msg.message, msg.retry_after_s)

    def _unreachable(self, cause: BaseException) -> PoolError:
        return unavailable(self.socket_path, cause)

    def _lost(self, err: PoolError) -> None:
        """The connection is gone, or no longer usable: every waiter gets the reason (the
        daemon's own last word, when it said why it closed)."""
        if self._gone is None or self._gone.done():
            return
        self._gone.set_result(None)
        if self._transport is not None:
            self._transport.abort()
        self._why_gone = err
        gone = Error(id=None, code=err.code, message=err.message,
                     retry_after_s=err.retry_after_s)
        if self._welcomed is not None and not self._welcomed.done():
            self._welcomed.set_result(gone)
        for final in self._finals.values():
            if not final.done():
                final.set_result(gone)
        for stream in self._streams.values():
            stream.put_nowait(gone)

    # ---- writing ------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._flush)
        self._unsent.append(data)

    def _flush(self) -> None:
        if self._unsent and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._unsent))
        self._unsent.clear()

    def _send(self, msg: msgspec.Struct) -> None:
        """Sent; the caller then registers where its replies go, before any await (so
        before the reader can see one)."""
        if not self.connected:
            raise self._why_gone or PoolError(ErrorCode.UNAVAILABLE,
                                              "AsyncClient is not connected")
        self._write(make_frame(encode_checked(msg, self.welcome)))

    async def _final(self, msg: Any) -> Any:
        self._send(msg)
        final = asyncio.get_running_loop().create_future()
        self._finals[msg.id] = final
        try:
            return await final
        finally:
            self._finals.pop(msg.id, None)

    async def _request(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                       whole: bool = False) -> Any:
        call = unstreamed_call(op, next(self._ids), args, kwargs)
        parts = split_call(call, self._ids)
        try:
            replies = ([await self._final(parts[0])] if len(parts) == 1
                       else await asyncio.gather(*(self._final(part) for part in parts)))
        except asyncio.CancelledError:
            for part in parts:
                self._cancel(part.id)  # the daemon stops work nobody awaits any more
            raise
        if whole:
            return whole_reply(replies)
        return call.parse(replies[0]) if len(parts) == 1 else merged(call, replies)

    async def reply(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """The daemon's final reply message itself for an operation that does not
        stream (embed, embed_image, rerank; the arguments are that method's): e.g.
        Embeddings with .data, .shape and .tokens, the input tokens the model read."""
        return await self._request(op, args, kwargs, whole=True)

    def _cancel(self, rid: int) -> None:
        if self.connected:  # after its request, through the same buffer
            self._write(make_frame(encoder.encode(Cancel(id=rid))))

    async def _stream(self, call: Call) -> AsyncIterator[Any]:
        self._send(call.request)
        route: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call.id] = route
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
            self._streams.pop(call.id, None)
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

    async def reload(self) -> str:
        """Have the daemon read its config again and apply its models: what changed."""
        return check_reply(await self._final(ReloadConfig(id=next(self._ids)))).message

    # ---- jobs: as Client's ------------------------------------------------------------

    async def submit(self, op: str, *args: Any, stream: bool = False, **kwargs: Any) -> str:
        msg = submit_message(next(self._ids), op, args, kwargs, stream)
        return str(check_reply(await self._final(msg)).key)

    def follow(self, key: str) -> AsyncIterator[TextChunk]:
        """As Client.follow."""
        return self._stream(follow_call(next(self._ids), key))

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


def _async_method(kind: Kind) -> Callable[..., Any]:
    if kind.streaming:
        def stream(self: AsyncClient, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return self._stream(make_call(kind.op, next(self._ids), args, kwargs))

        return named_method(stream, kind, AsyncClient)

    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        return await self._request(kind.op, args, kwargs)

    return named_method(method, kind, AsyncClient)


for _kind in KINDS:
    setattr(AsyncClient, _kind.op, _async_method(_kind))
