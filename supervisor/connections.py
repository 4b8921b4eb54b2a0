"""Client connections: one Connection per client, and the table of them all, which bounds
their number, the replies they have not read (per client and in total) and how long
they may sit idle or take to send one frame.

A client that does not read its replies is paused first (the server reads none of its
requests while more than PAUSE_READING_BYTES of replies wait for it), then dropped: when
its own unread replies pass `max_client_buffer_bytes`, or when all clients' together
pass `max_unread_total_bytes` and it holds the most.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import HEADER, frame
from modelpool.protocol.messages import ClientsStatus, Error, encoder
from modelpool.protocol.peers import Peer
from modelpool.supervisor.access import AccessPolicy, ConnectionAccess
from modelpool.supervisor.config import DaemonConfig

log = logging.getLogger("modelpool.server")

PAUSE_READING_BYTES = 1 << 20  # unread replies above this: read no more of the client's requests
RESUME_READING_BYTES = 256 << 10  # ... until they drain below this
DISCARD_CHUNK = 1 << 16
READ_CHUNK = 1 << 20  # frames larger than this are read piecewise into their own buffer
SWEEP_MAX_S = 1.0

_serials = itertools.count(1)


class Connection:
    """One client connection; the ReplySink of every request it sent. `peer` is who the
    kernel says the client is (pid, uid, gid, groups), fixed for the connection's life;
    `access` applies the [access] policy to it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 table: ConnectionTable, policy: AccessPolicy, peer: Peer,
                 defer: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.table = table
        self.peer = peer
        self.access = ConnectionAccess(policy, self.peer)
        self.owner = (self.peer.uid, next(_serials))  # a turn within its user's, in the queues
        self.jobs: dict[int, Any] = {}
        self.tasks: set[asyncio.Task[None]] = set()  # replies being worked out (job API)
        self.closed = False
        self.counted = 0  # this connection's unread reply bytes when the table last looked
        self.last_active = table.now()
        # When the frame being read began; the hello is awaited from the first moment.
        self.frame_started: float | None = self.last_active
        writer.transport.set_write_buffer_limits(PAUSE_READING_BYTES, RESUME_READING_BYTES)
        # Replies made in one turn of the event loop leave in one write (one system call)
        # at its end: a worker's batch of 32 replies was 32 sends, a quarter of the
        # supervisor's time with no-op requests. `defer` is the loop's call_soon.
        self.defer = defer
        self.pending: list[bytes] = []
        self.pending_bytes = 0

    def unsent(self) -> int:
        """Reply bytes written but not yet taken by the client's socket."""
        return self.writer.transport.get_write_buffer_size() + self.pending_bytes

    def send(self, msg: msgspec.Struct) -> None:
        if self.closed or self.writer.transport.is_closing():
            return
        data = frame(encoder.encode(msg))
        if self.defer is None:
            self.writer.write(data)
        else:
            if not self.pending:
                self.defer(self.flush)
            self.pending.append(data)
            self.pending_bytes += len(data)
        self.last_active = self.table.now()
        self.table.note_unsent(self)

    def flush(self) -> None:
        if not self.pending:
            return
        data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
        self.pending.clear()
        self.pending_bytes = 0
        if not self.closed and not self.writer.transport.is_closing():
            self.writer.write(data)

    def close(self, abort: bool = False) -> None:
        if not abort:
            self.flush()  # what was said before closing still goes
        if not self.closed:
            self.closed = True
            if abort:
                self.writer.transport.abort()
            else:
                self.writer.close()
            self.table.remove(self)

    def goodbye(self, code: ErrorCode, message: str) -> None:
        """Say why, then close; at once if the client is not reading (nothing would drain)."""
        self.send(Error(id=None, code=code, message=message))
        self.flush()  # into the transport now: what it cannot take at once is not read
        self.close(abort=not self.closed and self.unsent() > 0)

    def drop(self, reason: str) -> None:
        log.warning("dropping a client: %s", reason)
        self.close(abort=True)

    # ---- reading ------------------------------------------------------------------------

    async def next_frame(self, limit: int) -> bytes | bytearray | None:
        """The client's next frame; None when it is gone. An oversized frame is answered at
        once and its bytes are discarded as they arrive (the framing stays intact, so the
        connection stays usable); the frame timeout bounds how long that may take."""
        await self.writer.drain()  # backpressure: no new requests while replies back up
        while not self.closed:
            header = await self._read(HEADER.size, mid_frame=False)
            if header is None:
                return None
            (size,) = HEADER.unpack(header)
            if self.frame_started is None:
                self.frame_started = self.table.now()
            if size <= limit:
                payload = await (self._read(size, mid_frame=True) if size <= READ_CHUNK
                                 else self._read_large(size))
                self._frame_done()
                return payload
            self.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                            message=f"frame of {size} bytes exceeds the limit of {limit}; "
                                    f"its bytes are skipped"))
            while size > 0:
                chunk = await self._read(min(size, DISCARD_CHUNK), mid_frame=True)
                if chunk is None:
                    return None
                size -= len(chunk)
            self._frame_done()
        return None

    async def _read(self, size: int, mid_frame: bool) -> bytes | None:
        try:
            return await self.reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial or mid_frame:
                self.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                                message=f"truncated frame: the stream ended after "
                                        f"{len(exc.partial)} of {size} bytes"))
            return None

    async def _read_large(self, size: int) -> bytearray | None:
        """A large body, grown as its bytes arrive: readexactly would hold it twice at the
        end (the reader's buffer and the copy it returns)."""
        body = bytearray()
        while len(body) < size:
            chunk = await self.reader.read(min(size - len(body), READ_CHUNK))
            if not chunk:
                self.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                                message=f"truncated frame: the stream ended after "
                                        f"{len(body)} of {size} bytes"))
                return None
            body += chunk
        return body

    def _frame_done(self) -> None:
        self.frame_started = None
        self.last_active = self.table.now()


class ConnectionTable:
    """Every live connection: their number, their unread replies, their timeouts."""

    def __init__(self, config: DaemonConfig, max_connections: int,
                 now: Callable[[], float]) -> None:
        self.max_connections = max_connections
        self.max_unsent = config.max_client_buffer_bytes
        self.max_unsent_total = config.max_unread_total_bytes
        self.idle_timeout_s = config.idle_timeout_s
        self.frame_timeout_s = config.frame_timeout_s
        self.now = now
        self.live: set[Connection] = set()
        self.opening = 0  # accepted, not yet live
        # Unread reply bytes of all connections: exact after each sweep and each shedding,
        # an overestimate in between (a client's reads are not seen until its next reply).
        self.unsent_total = 0

    def reserve(self) -> bool:
        """A place for a client just accepted, or False when max_connections are taken."""
        if len(self.live) + self.opening >= self.max_connections:
            return False
        self.opening += 1
        return True

    def admit(self, conn: Connection) -> None:
        """The reserved place, taken."""
        self.opening -= 1
        self.live.add(conn)

    def release(self) -> None:
        """The reserved place, given back unused."""
        self.opening -= 1

    def remove(self, conn: Connection) -> None:
        if conn in self.live:
            self.live.discard(conn)
            self.unsent_total -= conn.counted
            conn.counted = 0

    def note_unsent(self, conn: Connection) -> None:
        """A reply was written to conn: enforce the per-client and the total caps."""
        size = conn.unsent()
        self.unsent_total += size - conn.counted
        conn.counted = size
        if size > self.max_unsent:
            conn.drop(f"{size} bytes of replies unread, over max_client_buffer_bytes "
                      f"({self.max_unsent})")
        elif self.unsent_total > self.max_unsent_total:
            self._shed()

    def _shed(self) -> None:
        """Over the total: recount exactly, then drop whoever holds the most (always over
        their fair share, the total over the number of clients) until under the cap."""
        self.recount()
        while self.unsent_total > self.max_unsent_total and self.live:
            hog = max(self.live, key=lambda c: c.counted)
            hog.drop(f"{hog.counted} bytes of replies unread, the most of any client, while "
                     f"all clients' unread replies ({self.unsent_total}) are over "
                     f"max_unread_total_bytes ({self.max_unsent_total})")

    def recount(self) -> None:
        for conn in self.live:
            conn.counted = conn.unsent()
        self.unsent_total = sum(conn.counted for conn in self.live)

    def status(self) -> ClientsStatus:
        self.recount()
        return ClientsStatus(connections=len(self.live), max_connections=self.max_connections,
                             unread_reply_bytes=self.unsent_total,
                             max_unread_total_bytes=self.max_unsent_total)

    @property
    def sweep_interval_s(self) -> float:
        timeouts = [t for t in (self.idle_timeout_s, self.frame_timeout_s) if t > 0]
        return min([SWEEP_MAX_S, *(t / 4 for t in timeouts)])

    def sweep(self) -> None:
        """Close connections idle too long or too slow to send a frame; recount."""
        now = self.now()
        for conn in list(self.live):
            if conn.frame_started is not None and now - conn.frame_started > self.frame_timeout_s:
                conn.goodbye(ErrorCode.BAD_REQUEST,
                             f"a frame did not arrive whole within frame_timeout_s "
                             f"({self.frame_timeout_s:g} s): closing")
            elif (self.idle_timeout_s > 0 and not conn.jobs and conn.frame_started is None
                  and now - conn.last_active > self.idle_timeout_s):
                conn.goodbye(ErrorCode.UNAVAILABLE,
                             f"closing a connection idle for {self.idle_timeout_s:g} s "
                             f"(idle_timeout_s)")
        self.recount()
