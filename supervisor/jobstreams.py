"""A streamed job's replies, kept while it runs and for a while after, so that any
connection of its user may follow it (Follow): from its first chunk, live, to its end,
as often as asked. A client whose connection dropped takes it up again and, counting what
it had, carries on (the HTTP Responses API's `starting_after`).

The node a streamed job was submitted to keeps its stream: the job's pieces come to it as
a relayed stream's do (pgstreams.py; without a cluster, from its own pool), and the rest
from the job's result. Another node of the cluster follows it by asking that node for the
pieces it kept (on its channel), from the first, then live, under a key of its own: made
into chunks as the keeper made them, they are the same chunks. A job followed where no
stream of it is kept (submitted without `stream`, or ended long ago, or its keeper gone
or silent) comes whole, as one chunk and its End, once it has ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.jobs import ENDED, Follow, JobResult, Submit
from modelpool.protocol.kinds import BY_OP, KIND_OF
from modelpool.protocol.messages import Chunk, End, Error, encoder
from modelpool.supervisor.jobservice import new_key
from modelpool.supervisor.pgstreams import (
    BEGIN,
    DONE,
    FOLLOW_MARK,
    NOT_KEPT,
    StreamAssembly,
    StreamPiece,
    follow_ask,
    follow_mark,
    follow_stop,
)
from modelpool.supervisor.relay import final_replies, follow_pieces, piece_chunk

if TYPE_CHECKING:
    from modelpool.supervisor.jobservice import JobService

KEPT_BYTES = 64 << 20  # ended streams kept, at most (the oldest go first)
RESULT_WAIT_S = 3600.0  # one wait for a result; waited again while the job goes on
# How long a follow waits for the node that keeps the stream to begin sending it, and
# for the rest of it once the job has ended; then the result comes whole.
KEEPER_WAIT_S = 2.0


class KeptStream:
    """One job's replies as its client would have had them (ids 0), to its End or
    Error."""

    def __init__(self) -> None:
        self.replies: list[Chunk | End | Error] = []
        self.pieces: list[StreamPiece] = []  # what its chunks were made of, for other nodes
        self.nbytes = 0
        self.ended_at: float | None = None
        self._grew = asyncio.Event()

    def add(self, msg: Chunk | End | Error, piece: StreamPiece | None = None) -> None:
        self.replies.append(msg)
        self.nbytes += len(encoder.encode(msg))
        if piece is not None:
            self.pieces.append(piece)
            self.nbytes += len(piece.text)
        self._grew.set()  # wakes those following it; the next reply sets a new one
        self._grew = asyncio.Event()

    async def each_piece(self, send: Callable[[StreamPiece], None]) -> None:
        """Every piece to `send`, live as they come, until the stream ends."""
        async for piece in self._live(self.pieces):
            send(piece)

    async def replay(self, rid: int, send: Callable[[Any], None]) -> End | Error:
        """Every chunk to `send`, live as they come; the final reply returned."""
        async for msg in self._live(self.replies):
            if type(msg) is not Chunk:
                return msgspec.structs.replace(msg, id=rid)
            send(msgspec.structs.replace(msg, id=rid))
        raise AssertionError("a stream ends with its final reply")

    async def _live(self, items: list[Any]) -> AsyncIterator[Any]:
        """Each of `items` (a list this stream grows) as it comes, until the stream ends."""
        sent = 0
        while True:
            grew = self._grew
            while sent < len(items):
                sent += 1
                yield items[sent - 1]
            if self.replies and type(self.replies[-1]) is not Chunk:
                return
            await grew.wait()


class JobStreams:
    """The streams kept of the jobs submitted here with `stream`, by key."""

    def __init__(self, jobs: JobService) -> None:
        self.jobs = jobs
        self._kept: dict[str, KeptStream] = {}
        # the ended ones, in the order they ended (the oldest go first), and their bytes
        self._ended: dict[str, KeptStream] = {}
        self._ended_bytes = 0
        self._watching: set[asyncio.Task[None]] = set()
        self._sending: dict[str, asyncio.Task[None]] = {}  # to other nodes, by their key

    async def submit(self, uid: int, msg: Submit, nbytes: int) -> str:
        """The job submitted (its key); a streamed text job's stream kept here."""
        if not msg.stream or KIND_OF[type(msg.request)].reply != "text":
            return await self.jobs.submit(uid, msg, nbytes)
        followers, channel = self.jobs.followed()
        # other nodes' follows of the streams kept here
        followers.asked, followers.stopped = self._asked, self._stopped
        key = new_key()
        pieces = followers.follow(key)  # before it can start: no piece is missed
        try:
            await self.jobs.submit(uid, msg, nbytes, key=key, stream_to=channel)
        except BaseException:
            followers.forget(key)
            raise
        self._drop_old()
        kept = self._kept[key] = KeptStream()
        task = asyncio.get_running_loop().create_task(self._watch(uid, key, pieces, kept))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)
        return key

    async def follow(self, uid: int, msg: Follow, send: Callable[[Any], None]) -> list[Any]:
        """A Follow's replies: its chunks go to `send`, the final reply is returned."""
        try:
            record = await self.jobs.record(uid, msg.key)  # its user's only
            if BY_OP[record.op].reply != "text":
                raise PoolError(ErrorCode.BAD_REQUEST, f"job {msg.key} is {record.op}: only "
                                "a generate or describe job streams")
            kept = self._kept.get(msg.key)
            if kept is not None:
                return [await kept.replay(msg.id, send)]
            keeper = record.stream_to  # the channel of the node that keeps its stream
            if keeper and self.jobs.streams and keeper != self.jobs.streams.channel:
                replies = await self._from_keeper(uid, msg, keeper, send)
                if replies is not None:
                    return replies
            result = await self._result(uid, msg.key)
            return final_replies(msg.id, result, StreamAssembly())
        except PoolError as exc:
            return [Error(id=msg.id, code=exc.code, message=exc.message,
                          retry_after_s=exc.retry_after_s)]

    def forget(self, key: str) -> None:
        """Its job was forgotten: so is its stream."""
        self._kept.pop(key, None)
        if (kept := self._ended.pop(key, None)) is not None:
            self._ended_bytes -= kept.nbytes

    def close(self) -> None:
        """The daemon stops: nothing more is watched or sent."""
        for task in (*self._watching, *self._sending.values()):
            task.cancel()

    async def _watch(self, uid: int, key: str, pieces: asyncio.Queue[StreamPiece],
                     kept: KeptStream) -> None:
        assembly = StreamAssembly()
        try:
            result = await follow_pieces(
                self._result(uid, key), pieces, assembly,
                lambda piece: kept.add(piece_chunk(0, assembly.chunks - 1, piece),
                                       piece if self.jobs.streams else None))  # for nodes
            replies = final_replies(0, result, assembly)
        except PoolError as exc:
            replies = [Error(id=0, code=exc.code, message=exc.message)]
        finally:
            self.jobs.followed()[0].forget(key)
        for msg in replies:
            kept.add(msg)
        kept.ended_at = self.jobs.pool.scheduler.wall()
        if self._kept.get(key) is kept:  # (not forgotten meanwhile)
            self._ended[key] = kept
            self._ended_bytes += kept.nbytes

    def _asked(self, job_key: str, reply_key: str, channel: str) -> None:
        """Another node follows a stream: what is kept of it is sent to its channel under
        its key, then the rest live, between marks (none if nothing of it is kept)."""
        assert self.jobs.streams is not None
        kept = self._kept.get(job_key)
        if kept is None:
            self.jobs.streams.publisher.publish_text(channel, follow_mark(reply_key, NOT_KEPT))
            return
        task = asyncio.get_running_loop().create_task(self._send_kept(kept, reply_key, channel))
        self._sending[reply_key] = task
        task.add_done_callback(lambda _: self._sending.pop(reply_key, None))

    def _stopped(self, reply_key: str) -> None:
        """The follower on another node left before the end: no more is sent to it."""
        if (task := self._sending.get(reply_key)) is not None:
            task.cancel()

    async def _send_kept(self, kept: KeptStream, reply_key: str, channel: str) -> None:
        assert self.jobs.streams is not None
        publisher = self.jobs.streams.publisher
        publisher.publish_text(channel, follow_mark(reply_key, BEGIN))
        await kept.each_piece(lambda piece: publisher.publish(
            channel, dataclasses.replace(piece, key=reply_key)))
        publisher.publish_text(channel, follow_mark(reply_key, DONE))

    async def _from_keeper(self, uid: int, msg: Follow, keeper: str,
                           send: Callable[[Any], None]) -> list[Any] | None:
        """The replies, from the pieces the node that keeps the stream sends; None if it
        keeps none of it, or does not answer."""
        assert self.jobs.streams is not None
        followers, publisher = self.jobs.streams.followers, self.jobs.streams.publisher
        reply_key = f"{msg.key}.{new_key()[:12]}"
        pieces = followers.follow(reply_key)
        sending = False  # the keeper sends: told to stop if its follower leaves first
        try:
            publisher.publish_text(keeper, follow_ask(msg.key, reply_key,
                                                      self.jobs.streams.channel))
            try:
                first = await asyncio.wait_for(pieces.get(), KEEPER_WAIT_S)
            except TimeoutError:
                return None
            if (first.part, first.text) != (FOLLOW_MARK, BEGIN):
                return None
            sending, assembly = True, StreamAssembly()
            result = await follow_pieces(
                self._result(uid, msg.key), pieces, assembly,
                lambda piece: send(piece_chunk(msg.id, assembly.chunks - 1, piece)),
                KEEPER_WAIT_S)
            sending = False
            return final_replies(msg.id, result, assembly)
        finally:
            followers.forget(reply_key)
            if sending:
                publisher.publish_text(keeper, follow_stop(reply_key))

    async def _result(self, uid: int, key: str) -> JobResult:
        """The job's result once it has ended; its failure raised."""
        while True:
            try:
                return await self.jobs.retrieve(uid, key, RESULT_WAIT_S, 0)
            except PoolError as exc:  # TIMEOUT is also a code a job may end with
                if exc.code is not ErrorCode.TIMEOUT or \
                        (await self.jobs.info(uid, key)).state in ENDED:
                    raise

    def _drop_old(self) -> None:
        """Ended streams past the results' retention, and the oldest over KEPT_BYTES
        (from the oldest, only as many as go: a flood of submissions costs no scan)."""
        since = self.jobs.pool.scheduler.wall() - self.jobs.config.result_retention_s
        while self._ended:
            key, kept = next(iter(self._ended.items()))
            assert kept.ended_at is not None
            if kept.ended_at >= since and self._ended_bytes <= KEPT_BYTES:
                return
            self.forget(key)

