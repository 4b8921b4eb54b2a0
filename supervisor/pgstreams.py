"""A relayed stream's text, from the node that runs it to the node its client is on, as
it is made: PostgreSQL notifications on a channel of the client's node (every node
LISTENs on its own), so that a chat streamed through any node streams.

Each piece says which part of the answer it is of (its text, its thinking, its tokens'
log-probabilities, a tool call's head or arguments), where it starts in that part (in
characters; in tokens for the log-probabilities), and which claim of the job made it.
Notifications of one sender arrive in the order they committed, but a reconnection can
lose some: the receiving node sends its client a part only while it has all of it from
the start, and the rest from the job's stored result, which always has all of it
(StreamAssembly). A job run again after a node was lost makes its text anew, perhaps
otherwise: a client that already had part of the first run's ends WORKER_DIED, as a
local stream whose worker died does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec

from modelpool.protocol.errors import PoolError
from modelpool.protocol.jobs import Completion
from modelpool.protocol.messages import CallDelta, TokenLogprob

log = logging.getLogger("modelpool.cluster")

CHANNEL_PREFIX = "modelpool_stream_"
# A node asking, on the channel of the node that keeps a streamed job's stream
# (jobstreams.py), for its pieces under a key of the asker's: "? JOB REPLY_KEY CHANNEL",
# and to stop sending them when its follower left first: "x REPLY_KEY"; the keeper's
# marks around them, on the asker's channel: "! REPLY_KEY WORD"
FOLLOW_ASK, FOLLOW_STOP, FOLLOW_MARK = "?", "x", "!"
BEGIN, NOT_KEPT, DONE = "begin", "none", "end"
PAYLOAD_BYTES = 7900  # PostgreSQL refuses a notification of 8,000 bytes or more
MAX_BATCH = 256
# thinking, log-probabilities, call i's head, call i's arguments
PART = re.compile(r"[rl]|[hc]\d{1,3}")


def stream_channel(node: str) -> str:
    """The node's channel: an identifier whatever characters its name has."""
    return CHANNEL_PREFIX + hashlib.sha256(node.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StreamPiece:
    key: str
    attempt: int
    offset: int  # where its text starts in its part, in characters
    text: str
    # "": the answer's text; "r": its thinking; "l": its tokens' log-probabilities (as
    # JSON); "h<i>": call i's head (its CallDelta without arguments, as JSON); "c<i>":
    # call i's arguments
    part: str = ""

    @cached_property
    def value(self) -> Any:
        """What a JSON part's text reads as, read once: the entries, the call's head
        (None: it does not read; a text part's is its text)."""
        shape = {"l": list[TokenLogprob], "h": CallDelta}.get(self.part[:1])
        if shape is None:
            return self.text
        try:
            return msgspec.json.decode(self.text, type=shape)
        except msgspec.DecodeError:
            return None


def call_head(delta: CallDelta) -> str:
    return msgspec.json.encode(CallDelta(index=delta.index, name=delta.name,
                                         id=delta.id)).decode()


def logprobs_text(entries: list[TokenLogprob]) -> str:
    return msgspec.json.encode(entries).decode()


def payloads(piece: StreamPiece) -> list[str]:
    """The piece as notification payloads, its text split where one would be too long;
    none for a text PostgreSQL cannot carry (a NUL): its receiver sees a gap."""
    whole_only = piece.part == "l" or piece.part.startswith("h")
    if "\x00" in piece.text or (whole_only and len(piece.text) > PAYLOAD_BYTES // 2):
        return []  # JSON (a call's head, log-probabilities) is sent whole or not at all
    found, offset, text = [], piece.offset, piece.text
    tag = f"{piece.part}:" if piece.part else ""  # none: as nodes before parts sent text
    while True:
        head = f"{piece.key} {piece.attempt} {tag}{offset} "
        room = PAYLOAD_BYTES - len(head)
        part = text[:room].encode()[:room].decode(errors="ignore")  # whole characters
        found.append(head + part)
        text, offset = text[len(part):], offset + len(part)
        if not text:
            return found


def follow_ask(job_key: str, reply_key: str, channel: str) -> str:
    return f"{FOLLOW_ASK} {job_key} {reply_key} {channel}"


def follow_stop(reply_key: str) -> str:
    return f"{FOLLOW_STOP} {reply_key}"


def follow_mark(reply_key: str, word: str) -> str:
    return f"{FOLLOW_MARK} {reply_key} {word}"


def parse(payload: str) -> StreamPiece | None:
    key, _, rest = payload.partition(" ")
    attempt, _, rest = rest.partition(" ")
    position, _, text = rest.partition(" ")
    part, _, offset = position.rpartition(":")
    if not (attempt.isdigit() and offset.isdigit()) or (part and not PART.fullmatch(part)):
        return None
    piece = StreamPiece(key, int(attempt), int(offset), text, part)
    return None if piece.value is None else piece


class StreamPublisher:
    """Pieces sent while a statement is in flight go together in the next (one
    statement a round trip, however many streams). A piece that cannot be sent is
    dropped: its receiver takes the text from the stored result."""

    def __init__(self, fetch: Callable[[str, dict[str, list[str]]], Awaitable[object]]) -> None:
        self._fetch = fetch
        self._pending: list[tuple[str, str]] = []  # (channel, payload)
        self._flushing: asyncio.Task[None] | None = None

    def publish(self, channel: str, piece: StreamPiece) -> None:
        for payload in payloads(piece):
            self.publish_text(channel, payload)

    def publish_text(self, channel: str, payload: str) -> None:
        self._pending.append((channel, payload))
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
    """The relayed streams this node's clients wait on, by job key (or the key a follow
    asked another node to send a kept stream under: its marks come as pieces of part
    FOLLOW_MARK)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[StreamPiece]] = {}
        # another node's follow of a stream kept here: (job key, its key, its channel),
        # and its end when its follower left first (its key)
        self.asked: Callable[[str, str, str], None] | None = None
        self.stopped: Callable[[str], None] | None = None

    def follow(self, key: str) -> asyncio.Queue[StreamPiece]:
        return self._queues.setdefault(key, asyncio.Queue())

    def forget(self, key: str) -> None:
        self._queues.pop(key, None)

    def notified(self, payload: str) -> None:
        head, _, rest = payload.partition(" ")
        if head == FOLLOW_ASK:
            asked = rest.split(" ")
            if len(asked) == 3 and self.asked is not None:
                self.asked(*asked)
        elif head == FOLLOW_STOP:
            if self.stopped is not None:
                self.stopped(rest)
        elif head == FOLLOW_MARK:
            key, _, word = rest.partition(" ")
            self.take(StreamPiece(key, 0, 0, word, FOLLOW_MARK))
        elif (piece := parse(payload)) is not None:
            self.take(piece)

    def take(self, piece: StreamPiece) -> None:
        if piece.key in self._queues:
            self._queues[piece.key].put_nowait(piece)


@dataclass(frozen=True)
class RelayedStreams:
    """A node's end of relayed streams: its channel, its clients' streams, and the
    publisher of the streams it runs."""

    channel: str
    followers: StreamFollowers
    publisher: StreamPublisher


@dataclass
class StreamAssembly:
    """What a relayed stream's client is sent: the parts of one claim of the job, in
    order, with nothing missing (pure: the relay feeds it pieces and the result)."""

    parts: dict[str, str] = field(default_factory=dict)  # what the client has, by part
    logprobs: int = 0  # the tokens' log-probabilities it has
    attempt: int | None = None
    gap: bool = False  # a piece was lost: the rest waits for the result
    chunks: int = 0  # sent to the client

    @property
    def sent(self) -> str:
        return self.parts.get("", "")

    def take(self, piece: StreamPiece) -> bool | None:
        """Whether to send the piece now, or None if the client's stream is broken: it
        has part of a run that another replaced."""
        if self.attempt != piece.attempt:
            if any(self.parts.values()) or self.logprobs:
                return None
            self.attempt, self.gap, self.parts = piece.attempt, False, {}
        have = self.logprobs if piece.part == "l" else len(self.parts.get(piece.part, ""))
        if self.gap or piece.offset < have:
            return False  # sent already, or behind a gap
        if piece.offset > have or not self._follows(piece.part):
            self.gap = True
            return False
        if piece.part == "l":
            self.logprobs += len(piece.value or ())
        else:
            self.parts[piece.part] = self.parts.get(piece.part, "") + piece.text
        self.chunks += bool(piece.text)
        return bool(piece.text)

    def _follows(self, part: str) -> bool:
        """A call's arguments follow its head, and its head the call's before it."""
        if part[:1] == "c":
            return f"h{part[1:]}" in self.parts
        return part[:1] != "h" or part == "h0" or f"h{int(part[1:]) - 1}" in self.parts

    def rest(self, final: Completion
             ) -> tuple[str, str, list[TokenLogprob], list[CallDelta]] | None:
        """What the client lacks of the finished answer (its text, its thinking, its
        tokens' log-probabilities, the rest of each call it has the head of), or None if
        what it has is not the start of it (another run's)."""
        text = _after(self.sent, final.text)
        thinking = _after(self.parts.get("r", ""), final.reasoning)
        calls = []
        for index, call in enumerate(final.tool_calls or ()):
            head = self.parts.get(f"h{index}")
            if head is None:
                break  # this and the rest come whole with the end
            arguments = _after(self.parts.get(f"c{index}", ""), call.arguments)
            if arguments is None or head != call_head(CallDelta(index=index, name=call.name,
                                                                  id=call.id)):
                return None
            if arguments:
                calls.append(CallDelta(index=index, arguments=arguments))
        if text is None or thinking is None:
            return None
        return text, thinking, (final.logprobs or [])[self.logprobs:], calls


def _after(have: str, whole: str) -> str | None:
    return whole[len(have):] if whole.startswith(have) else None
