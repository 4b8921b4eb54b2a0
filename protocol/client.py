"""The Python client library: Client (blocking) and AsyncClient (asyncio).

    with Client() as c:
        v = c.embed("hello")                       # numpy float32, shape (384,)
        for chunk in c.generate("Once", model="tiny-llm", max_tokens=16):
            print(chunk.text, end="")              # the last chunk has .finish_reason

One connection multiplexes many requests; replies are matched by request id.
A Client is for one thread; an AsyncClient serves any number of tasks on its loop.
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
import numpy as np

from modelpool.protocol.client_support import (
    FINAL,
    ImageChunk,
    ImageLike,
    TextChunk,
    check_reply,
    describe_msg,
    embed_image_msg,
    embed_msg,
    encode_checked,
    generate_image_msg,
    generate_msg,
    image_chunk,
    is_last,
    request_options,
    text_chunk,
    unavailable,
    undecodable,
    vectors_of,
)
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import MAX_FRAME_BYTES, read_frame, recv_frame, send_frame
from modelpool.protocol.framing import frame as make_frame
from modelpool.protocol.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Error,
    GetStatus,
    Hello,
    ListModels,
    LoadModel,
    Priority,
    StopDaemon,
    UnloadModel,
    Welcome,
    encoder,
    server_decoder,
    to_builtins,
)
from modelpool.protocol.paths import default_socket_path

__all__ = ["AsyncClient", "Client", "ErrorCode", "ImageChunk", "PoolError", "TextChunk"]

class Client:
    """Blocking client. Not thread-safe: use one per thread."""

    def __init__(self, socket_path: str | None = None, timeout_s: float | None = None,
                 name: str = "python") -> None:
        self.socket_path = socket_path or default_socket_path()
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
        self._send(Hello(protocol_version=PROTOCOL_VERSION, client=name))
        self.welcome: Welcome = check_reply(self._recv())

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
                if isinstance(msg, FINAL):
                    self._dropped.discard(mid)
                continue
            self._inbox[mid].append(msg)

    def _call(self, msg: Any) -> Any:
        self._send(msg)
        reply = self._next(msg.id)
        self._inbox.pop(msg.id, None)
        return check_reply(reply)

    def embed(self, texts: str | list[str], model: str | None = None, *,
              priority: Priority = "normal", timeout_s: float | None = None,
              deadline_s: float | None = None) -> np.ndarray:
        """float32 vectors: shape (dim,) for one text, (n, dim) for a list."""
        msg = embed_msg(next(self._ids), texts, model,
                         **request_options(priority, timeout_s, deadline_s))
        self._send(msg)
        reply = self._next(msg.id)
        self._inbox.pop(msg.id, None)
        return vectors_of(reply, isinstance(texts, str))

    def generate(self, prompt: str | list[dict[str, str]], model: str | None = None, *,
                 max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None,
                 ignore_eos: bool = False, raw: bool = False, priority: Priority = "normal",
                 timeout_s: float | None = None,
                 deadline_s: float | None = None) -> Iterator[TextChunk]:
        """Stream text chunks; breaking out of the loop cancels the request."""
        msg = generate_msg(next(self._ids), prompt, model, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, seed=seed, stop=stop or [],
                            ignore_eos=ignore_eos, raw=raw,
                            **request_options(priority, timeout_s, deadline_s))
        self._send(msg)
        return self._stream(msg.id)

    def embed_image(self, images: ImageLike | list[ImageLike], model: str | None = None, *,
                    priority: Priority = "normal", timeout_s: float | None = None,
                    deadline_s: float | None = None) -> np.ndarray:
        """float32 vectors: (dim,) for one image, (n, dim) for a list."""
        msg, single = embed_image_msg(next(self._ids), images, model,
                                      **request_options(priority, timeout_s, deadline_s))
        self._send(msg)
        reply = self._next(msg.id)
        self._inbox.pop(msg.id, None)
        return vectors_of(reply, single)

    def describe(self, image: ImageLike, query: str = "", model: str | None = None, *,
                 max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int | None = None, stop: list[str] | None = None,
                 ignore_eos: bool = False, priority: Priority = "normal",
                 timeout_s: float | None = None,
                 deadline_s: float | None = None) -> Iterator[TextChunk]:
        """Stream text about an image; "" asks for a caption."""
        msg = describe_msg(next(self._ids), image, query, model, stop, max_tokens=max_tokens,
                           temperature=temperature, top_p=top_p, seed=seed,
                           ignore_eos=ignore_eos,
                           **request_options(priority, timeout_s, deadline_s))
        self._send(msg)
        return self._stream(msg.id)

    def generate_image(self, prompt: str, model: str | None = None, *, steps: int = 25,
                       width: int = 512, height: int = 512, seed: int | None = None,
                       guidance: float = 7.5, negative_prompt: str = "",
                       preview_every: int = 0, priority: Priority = "normal",
                       timeout_s: float | None = None,
                       deadline_s: float | None = None) -> Iterator[ImageChunk]:
        """Progress per step; the last chunk has the PNG in .png."""
        msg = generate_image_msg(next(self._ids), prompt, model, steps=steps, width=width,
                                 height=height, seed=seed, guidance=guidance,
                                 negative_prompt=negative_prompt, preview_every=preview_every,
                                 **request_options(priority, timeout_s, deadline_s))
        self._send(msg)
        return self._stream(msg.id, image_chunk)

    def _stream(self, rid: int, parse: Callable[[Any], Any] = text_chunk) -> Iterator[Any]:
        finished = False
        try:
            while not finished:
                chunk = parse(self._next(rid))
                finished = is_last(chunk)
                yield chunk
        except PoolError:
            finished = True
            raise
        finally:
            self._inbox.pop(rid, None)
            if not finished and self._sock.fileno() != -1:  # a closed client needs no cancel
                self._dropped.add(rid)
                with contextlib.suppress(PoolError):
                    self._send(Cancel(id=rid))

    def status(self) -> dict[str, Any]:
        return to_builtins(self._call(GetStatus(id=next(self._ids))).status)

    def models(self) -> list[dict[str, Any]]:
        return to_builtins(self._call(ListModels(id=next(self._ids))).models)

    def load(self, model: str, workers: int = 1) -> str:
        return self._call(LoadModel(id=next(self._ids), model=model, workers=workers)).message

    def unload(self, model: str) -> str:
        return self._call(UnloadModel(id=next(self._ids), model=model)).message

    def stop(self) -> str:
        return self._call(StopDaemon(id=next(self._ids))).message


class AsyncClient:
    """asyncio client; any number of tasks may share one connection."""

    def __init__(self, socket_path: str | None = None, name: str = "python-async") -> None:
        self.socket_path = socket_path or default_socket_path()
        self.name = name
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
        self._writer.write(make_frame(encoder.encode(
            Hello(protocol_version=PROTOCOL_VERSION, client=self.name))))
        self.welcome = check_reply(server_decoder.decode(await read_frame(reader)))
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        return self

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

    async def _call(self, msg: Any) -> Any:
        route = self._open(msg)
        try:
            return check_reply(await route.get())
        finally:
            self._routes.pop(msg.id, None)

    async def embed(self, texts: str | list[str], model: str | None = None, *,
                    priority: Priority = "normal", timeout_s: float | None = None,
                    deadline_s: float | None = None) -> np.ndarray:
        msg = embed_msg(next(self._ids), texts, model,
                         **request_options(priority, timeout_s, deadline_s))
        route = self._open(msg)
        try:
            return vectors_of(await route.get(), isinstance(texts, str))
        finally:
            self._routes.pop(msg.id, None)

    async def generate(self, prompt: str | list[dict[str, str]], model: str | None = None, *,
                       max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                       seed: int | None = None, stop: list[str] | None = None,
                       ignore_eos: bool = False, raw: bool = False,
                       priority: Priority = "normal", timeout_s: float | None = None,
                       deadline_s: float | None = None) -> AsyncIterator[TextChunk]:
        msg = generate_msg(next(self._ids), prompt, model, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, seed=seed, stop=stop or [],
                            ignore_eos=ignore_eos, raw=raw,
                            **request_options(priority, timeout_s, deadline_s))
        async for chunk in self._stream(msg, text_chunk):
            yield chunk

    async def embed_image(self, images: ImageLike | list[ImageLike], model: str | None = None,
                          *, priority: Priority = "normal", timeout_s: float | None = None,
                          deadline_s: float | None = None) -> np.ndarray:
        msg, single = embed_image_msg(next(self._ids), images, model,
                                      **request_options(priority, timeout_s, deadline_s))
        route = self._open(msg)
        try:
            return vectors_of(await route.get(), single)
        finally:
            self._routes.pop(msg.id, None)

    async def describe(self, image: ImageLike, query: str = "", model: str | None = None, *,
                       max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0,
                       seed: int | None = None, stop: list[str] | None = None,
                       ignore_eos: bool = False, priority: Priority = "normal",
                       timeout_s: float | None = None,
                       deadline_s: float | None = None) -> AsyncIterator[TextChunk]:
        msg = describe_msg(next(self._ids), image, query, model, stop, max_tokens=max_tokens,
                           temperature=temperature, top_p=top_p, seed=seed,
                           ignore_eos=ignore_eos,
                           **request_options(priority, timeout_s, deadline_s))
        async for chunk in self._stream(msg, text_chunk):
            yield chunk

    async def generate_image(self, prompt: str, model: str | None = None, *, steps: int = 25,
                             width: int = 512, height: int = 512, seed: int | None = None,
                             guidance: float = 7.5, negative_prompt: str = "",
                             preview_every: int = 0, priority: Priority = "normal",
                             timeout_s: float | None = None,
                             deadline_s: float | None = None) -> AsyncIterator[ImageChunk]:
        msg = generate_image_msg(next(self._ids), prompt, model, steps=steps, width=width,
                                 height=height, seed=seed, guidance=guidance,
                                 negative_prompt=negative_prompt, preview_every=preview_every,
                                 **request_options(priority, timeout_s, deadline_s))
        async for chunk in self._stream(msg, image_chunk):
            yield chunk

    async def _stream(self, msg: Any, parse: Callable[[Any], Any]) -> AsyncIterator[Any]:
        route = self._open(msg)
        finished = False
        try:
            while not finished:
                chunk = parse(await route.get())
                finished = is_last(chunk)
                yield chunk
        except PoolError:
            finished = True
            raise
        finally:
            self._routes.pop(msg.id, None)
            if not finished and self._writer is not None and not self._writer.is_closing():
                self._writer.write(make_frame(encoder.encode(Cancel(id=msg.id))))

    async def status(self) -> dict[str, Any]:
        return to_builtins((await self._call(GetStatus(id=next(self._ids)))).status)

    async def models(self) -> list[dict[str, Any]]:
        return to_builtins((await self._call(ListModels(id=next(self._ids)))).models)

    async def load(self, model: str, workers: int = 1) -> str:
        return (await self._call(LoadModel(id=next(self._ids), model=model,
                                           workers=workers))).message

    async def unload(self, model: str) -> str:
        return (await self._call(UnloadModel(id=next(self._ids), model=model))).message

    async def stop(self) -> str:
        return (await self._call(StopDaemon(id=next(self._ids)))).message
