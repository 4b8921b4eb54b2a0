"""A relayed stream's text, from the node that runs it to the node its client is on, as
it is made: PostgreSQL notifications on a channel of the client's node (every node
LISTENs on its own), so that a chat streamed through any node streams.

Each piece says where its text starts in the whole (in characters), and which claim of
the job made it. Notifications of one sender arrive in the order they committed, but a
reconnection can lose some: the receiving node sends its client text only while it has
all of it from the start, and the rest from the job's stored result, which always has
all of it (StreamAssembly). A job run again after a node was lost makes its text anew,
perhaps otherwise: a client that already had part of the first run's ends WORKER_DIED,
as a local stream whose worker died does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from modelpool.protocol.errors import PoolError

log = logging.getLogger("modelpool.cluster")

CHANNEL_PREFIX = "modelpool_stream_"
PAYLOAD_BYTES = 7900  # PostgreSQL refuses a notification of 8,000 bytes or more
MAX_BATCH = 256


def stream_channel(node: str) -> str:
    """The node's channel: an identifier whatever characters its name has."""
    return CHANNEL_PREFIX + hashlib.sha256(node.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StreamPiece:
    key: str
    attempt: int
    offset: int  # where its text starts in the whole, in characters
    text: str


def payloads(piece: StreamPiece) -> list[str]:
    """The piece as notification payloads, its text split where one would be too long;
    none for a text PostgreSQL cannot carry (a NUL): its receiver sees a gap."""
    if "\x00" in piece.text:
        return []
    found, offset, text = [], piece.offset, piece.text
    while True:
        head = f"{piece.key} {piece.attempt} {offset} "
        room = PAYLOAD_BYTES - len(head)
        part = text[:room].encode()[:room].decode(errors="ignore")  # whole characters
        found.append(head + part)
        text, offset = text[len(part):], offset + len(part)
        if not text:
            return found


def parse(payload: str) -> StreamPiece | None:
    key, _, rest = payload.partition(" ")
    attempt, _, rest = rest.partition(" ")
    offset, _, text = rest.partition(" ")
    if not (attempt.isdigit() and offset.isdigit()):
        return None
    return StreamPiece(key, int(attempt), int(offset), text)


class StreamPublisher:
    """Pieces sent while a statement is in flight go together in the next (one
    statement a round trip, however many streams). A piece that cannot be sent is
    dropped: its receiver takes the text from the stored result."""

    def __init__(self, fetch: Callable[[str, dict[str, list[str]]], Awaitable[object]]) -> None:
        self._fetch = fetch
        self._pending: list[tuple[str, str]] = []  # (channel, payload)
        self._flushing: asyncio.Task[None] | None = None

    def publish(self, channel: str, piece: StreamPiece) -> None:
        self._pending.extend((channel, payload) for payload in payloads(piece))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:MAX_BATCH]
                del self._pending[:MAX_BATCH]
                try:
                    await self._fetch(
                        "SELECT count(pg_notify(c, p)) AS sent FROM unnest("
                        "%(channels)s::text[], %(payloads)s::text[]) AS t(c, p)",
                        {"channels": [c for c, _ in batch], "payloads": [p for _, p in batch]})
                except PoolError as exc:
                    log.debug("stream pieces not sent (%s): their results carry them", exc)
        finally:
            self._flushing = None


class StreamFollowers:
    """The relayed streams this node's clients wait on, by job key."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[StreamPiece]] = {}

    def follow(self, key: str) -> asyncio.Queue[StreamPiece]:
        return self._queues.setdefault(key, asyncio.Queue())

    def forget(self, key: str) -> None:
        self._queues.pop(key, None)

    def notified(self, payload: str) -> None:
        piece = parse(payload)
        if piece is not None and piece.key in self._queues:
            self._queues[piece.key].put_nowait(piece)


@dataclass(frozen=True)
class RelayedStreams:
    """A node's end of relayed streams: its channel, its clients' streams, and the
    publisher of the streams it runs."""

    channel: str
    followers: StreamFollowers
    publisher: StreamPublisher


class StreamAssembly:
    """What a relayed stream's client is sent: the text of one claim of the job, in
    order, with nothing missing (pure: the relay feeds it pieces and the result)."""

    def __init__(self) -> None:
        self.sent = ""  # what the client has
        self.attempt: int | None = None
        self.gap = False  # a piece was lost: the rest waits for the result
        self.chunks = 0  # sent to the client

    def take(self, piece: StreamPiece) -> str | None:
        """The text to send now ("" for none), or None if the client's stream is broken:
        it has part of a run that another replaced."""
        if self.attempt != piece.attempt:
            if self.sent:
                return None
            self.attempt, self.gap = piece.attempt, False
        if self.gap or piece.offset < len(self.sent):
            return ""  # sent already, or behind a gap
        if piece.offset > len(self.sent):
            self.gap = True
            return ""
        self.sent += piece.text
        self.chunks += bool(piece.text)
        return piece.text

    def rest(self, final_text: str) -> str | None:
        """What the client lacks of the finished text, or None if what it has is not
        the start of it (another run's)."""
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else None
