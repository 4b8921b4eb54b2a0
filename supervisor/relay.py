"""A direct request that another node of the cluster runs: submitted to the shared queue
as a job and answered from it as the direct path answers. A stream's text reaches the
client as the other node makes it (pgstreams.py: its text, thinking and tool calls), the
rest from the job's result."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.jobs import Completion, JobResult, Submit
from modelpool.protocol.kinds import KIND_OF
from modelpool.protocol.messages import CallDelta, Chunk, End, Error, WorkRequest
from modelpool.supervisor.jobservice import new_key
from modelpool.supervisor.pgstreams import FOLLOW_MARK, StreamAssembly, StreamPiece

if TYPE_CHECKING:
    from modelpool.supervisor.jobservice import JobService

# The job is cancelled when its client gives up on it.
GIVEN_UP = (ErrorCode.TIMEOUT, ErrorCode.WORKER_DIED)


async def relay(jobs: JobService, uid: int, request: WorkRequest,
                send: Callable[[Any], None]) -> list[Any]:
    """The final replies; a stream's chunks go to `send` as they come."""
    rid, key = request.id, new_key()
    streams = jobs.streams if KIND_OF[type(request)].streaming else None
    assembly = StreamAssembly()
    try:
        pieces = streams.followers.follow(key) if streams else None
        await jobs.submit(uid, Submit(id=rid, request=request), 0, key=key,
                          stream_to=streams.channel if streams else None)
        try:
            timeout = request.timeout_s or jobs.pool.config.pool.timeout_s
            result = await follow_pieces(
                jobs.retrieve(uid, key, timeout, rid), pieces, assembly,
                lambda piece: send(piece_chunk(rid, assembly.chunks - 1, piece)))
        except PoolError as exc:
            if exc.code in GIVEN_UP:
                await jobs.cancel(uid, key)
            raise
        except asyncio.CancelledError:  # the client went away or cancelled: so does its job
            with contextlib.suppress(PoolError):  # its one reply is the cancellation's
                await jobs.cancel(uid, key)
            raise
        finally:
            with contextlib.suppress(PoolError):  # else it expires with the others
                await jobs.mailbox.remove(key)
    except PoolError as exc:
        return [Error(id=rid, code=exc.code, message=exc.message,
                      retry_after_s=exc.retry_after_s)]
    finally:
        if streams:
            streams.followers.forget(key)
    return final_replies(rid, result, assembly)


async def follow_pieces(retrieve: Any, pieces: asyncio.Queue[StreamPiece] | None,
                        assembly: StreamAssembly, send_piece: Callable[[StreamPiece], None],
                        grace_s: float = 0.0) -> JobResult:
    """The job's result; meanwhile its stream's pieces, sent on as they come in order,
    and those that come within grace_s of the result (up to an end mark: pieces another
    node sends on, jobstreams.py)."""
    if pieces is None:
        return await retrieve
    result = asyncio.ensure_future(retrieve)
    try:
        while (piece := await _next_piece(pieces, result, grace_s)) is not None:
            taken = assembly.take(piece)
            if taken is None:
                raise PoolError(ErrorCode.WORKER_DIED, "the node running this stream went "
                                "away after sending part of it; it is being run again")
            if taken:
                send_piece(piece)
        return await result
    finally:
        if not result.done():
            result.cancel()
            with contextlib.suppress(asyncio.CancelledError, PoolError):
                await result
        elif not result.cancelled():
            result.exception()  # read: a failure is the caller's reply, not a log line


async def _next_piece(pieces: asyncio.Queue[StreamPiece], result: asyncio.Future[JobResult],
                      grace_s: float) -> StreamPiece | None:
    """The next piece; None at an end mark, or once the job has ended and no more came
    within grace_s."""
    if result.done() and grace_s <= 0:
        return None
    got = asyncio.ensure_future(pieces.get())
    await asyncio.wait({got, result}, return_when=asyncio.FIRST_COMPLETED)
    if not got.done() and grace_s > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(got), grace_s)
    if not got.done():
        got.cancel()
        return None
    piece = got.result()
    return None if piece.part == FOLLOW_MARK else piece


def piece_chunk(rid: int, seq: int, piece: StreamPiece) -> Chunk:
    """A relayed piece as the chunk a local stream would have sent."""
    if piece.part == "r":
        return Chunk(id=rid, seq=seq, text="", reasoning=piece.text)
    if piece.part == "l":  # JSON that does not read is never taken (parse)
        return Chunk(id=rid, seq=seq, text="", logprobs=piece.value)
    if piece.part[:1] == "h":
        return Chunk(id=rid, seq=seq, text="", calls=[msgspec.structs.replace(
            piece.value, index=int(piece.part[1:]))])
    if piece.part[:1] == "c":
        return Chunk(id=rid, seq=seq, text="", calls=[CallDelta(
            index=int(piece.part[1:]), arguments=piece.text)])
    return Chunk(id=rid, seq=seq, text=piece.text)


def final_replies(rid: int, result: JobResult, assembly: StreamAssembly) -> list[Any]:
    reply = result.result
    if not isinstance(reply, Completion):
        return [msgspec.structs.replace(reply, id=rid)]
    rest = assembly.rest(reply)
    if rest is None:
        return [Error(id=rid, code=ErrorCode.WORKER_DIED, message="the node running this "
                      "stream went away after sending part of it; it was run again")]
    end = End(id=rid, finish_reason=reply.finish_reason, prompt_tokens=reply.prompt_tokens,
              completion_tokens=reply.completion_tokens, model=reply.model,
              prompt_logprobs=reply.prompt_logprobs, tool_calls=reply.tool_calls,
              cached_tokens=reply.cached_tokens, reasoning_tokens=reply.reasoning_tokens)
    text, thinking, logprobs, calls = rest
    if not text and not thinking and not calls and not logprobs:
        return [end]
    return [Chunk(id=rid, seq=assembly.chunks, text=text, reasoning=thinking,
                  logprobs=logprobs or None, calls=calls or None), end]
