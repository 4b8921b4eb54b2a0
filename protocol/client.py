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

import collections
import contextlib
import itertools
import socket
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from modelpool.protocol.async_client import AsyncClient
from modelpool.protocol.client_core import (
    Call,
    ImageChunk,
    TextChunk,
    TextResult,
    check_reply,
    encode_checked,
    follow_call,
    is_final,
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
from modelpool.protocol.framing import MAX_FRAME_BYTES, recv_frame, send_frame
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
            raise self._parting_words() or unavailable(self.socket_path, exc) from exc

    def _parting_words(self) -> PoolError | None:
        """Why the daemon closed this connection (its last word, an error for no request:
        an idle timeout, access revoked by a reload), read from what is already here
        when a send finds the connection closed."""
        timeout = self._sock.gettimeout()
        self._sock.settimeout(0.0)
        try:
            while True:
                msg = server_decoder.decode(recv_frame(self._sock, MAX_FRAME_BYTES))
                if isinstance(msg, Error) and msg.id is None:
                    return PoolError(msg.code, msg.message, msg.retry_after_s)
                if (mid := getattr(msg, "id", None)) is not None:
                    self._inbox[mid].append(msg)  # a reply before it: kept, as _next does
        except (OSError, EOFError, msgspec.DecodeError):
            return None
        finally:
            self._sock.settimeout(timeout)

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
        replies = self._replies(call)
        return call.parse(replies[0]) if len(replies) == 1 else merged(call, replies)

    def reply(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """The daemon's final reply message itself for an operation that does not
        stream (embed, embed_image, rerank; the arguments are that method's): e.g.
        Embeddings with .data, .shape and .tokens, the input tokens the model read."""
        return whole_reply(self._replies(unstreamed_call(op, next(self._ids), args, kwargs)))

    def _replies(self, call: Any) -> list[Any]:
        """The final replies of a call that does not stream: its own, or its parts'."""
        parts = split_call(call, self._ids)
        return [self._final(call.request)] if len(parts) == 1 else self._all(parts)

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

    def reload(self) -> str:
        """Have the daemon read its config again and apply its models: what changed."""
        return check_reply(self._final(ReloadConfig(id=next(self._ids)))).message

    # ---- jobs: hand work over now, collect the result later, from any connection -------

    def submit(self, op: str, *args: Any, stream: bool = False, **kwargs: Any) -> str:
        """Submit `op` ("embed", "generate", ...) with that method's arguments; returns
        the job's key at once. The job runs even if this client goes away. `stream`
        (generate, describe): its chunks are kept as it runs, for `follow`."""
        msg = submit_message(next(self._ids), op, args, kwargs, stream)
        return str(check_reply(self._final(msg)).key)

    def follow(self, key: str) -> Iterator[TextChunk]:
        """A generate or describe job's chunks, as its direct call's stream would have
        come: from the first, live while it runs, to the last (with finish_reason), from
        any connection, as often as asked. A job submitted without `stream` (or whose
        stream is no longer kept) comes whole once it has ended: one chunk, then the
        end. Breaking out stops the following, not the job."""
        call = follow_call(next(self._ids), key)
        self._send(call.request)
        return self._stream(call)

    def retrieve(self, key: str, timeout_s: float = 30.0) -> Any:
        """What the direct call returns (an array; a TextResult for generate and
        describe; the final ImageChunk for generate_image; the reply itself for tokenize
        and detokenize), or PoolError with the job's
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


def _sync_method(kind: Kind) -> Callable[..., Any]:
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        return self._request(kind.op, args, kwargs)

    return named_method(method, kind, Client)


for _kind in KINDS:
    setattr(Client, _kind.op, _sync_method(_kind))
