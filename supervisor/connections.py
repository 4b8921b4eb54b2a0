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
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import FrameReader, frame
from modelpool.protocol.messages import Error, encoder
from modelpool.protocol.peers import Peer
from modelpool.protocol.status import ClientsStatus
from modelpool.supervisor.acceptor import auto_max_connections
from modelpool.supervisor.access import (
    REFUSED_HELLO_BYTES,
    REFUSED_HELLO_S,
    AccessPolicy,
    ConnectionAccess,
)
from modelpool.supervisor.config import DaemonConfig

log = logging.getLogger("modelpool.server")

PAUSE_READING_BYTES = 1 << 20  # unread replies above this: read no more of the client's requests
RESUME_READING_BYTES = 256 << 10  # ... until they drain below this
SWEEP_MAX_S = 1.0

_serials = itertools.count(1)


class ClientHandler(Protocol):
    """Where a connection's frames go: the hello, then every request; and who cleans up
    after it (its requests, its tasks) once it is gone."""

    def greet(self, conn: Connection, payload: bytes | bytearray) -> bool: ...

    def handle_frame(self, conn: Connection, payload: bytes | bytearray) -> None: ...

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """Around the frames of one read, handled together."""
        ...

    def gone(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection; the ReplySink of every request it sent. `peer` is who the
    kernel says the client is (pid, uid, gid, groups), fixed for the connection's life;
    `access` applies the [access] policy to it.

    Frames are taken from the bytes as they arrive and handed on at once, in the loop's
    callback: no task, future or readexactly per frame (those were a tenth of the
    supervisor's time per request with 16 busy connections)."""

    def __init__(self, table: ConnectionTable, policy: AccessPolicy, peer: Peer,
                 handler: ClientHandler, limit: int,
                 defer: Callable[[Callable[[], None]], object] | None = None) -> None:
        self.table = table
        self.peer = peer
        self.access = ConnectionAccess(policy, self.peer)
        self.handler = handler
        self.limit = limit
        self.transport: Any = None  # an asyncio.Transport once connected
        self.owner = (self.peer.uid, next(_serials))  # a turn within its user's, in the queues
        self.jobs: dict[int, Any] = {}
        self.tasks: set[asyncio.Task[Any]] = set()  # replies being worked out (job API)
        self.relays: dict[int, asyncio.Task[Any]] = {}  # of those, direct requests run elsewhere
        self.closed = False
        self.counted = 0  # this connection's unread reply bytes when the table last looked
        self.last_active = table.now()
        # When the frame being read began; the hello is awaited from the first moment.
        self.frame_started: float | None = self.last_active
        # Replies made in one turn of the event loop leave in one write (one system call)
        # at its end: a worker's batch of 32 replies was 32 sends, a quarter of the
        # supervisor's time with no-op requests. `defer` is the loop's call_soon.
        self.defer = defer
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.frames = FrameReader()
        self.greeted = False
        self.refused = False  # turned away: only its hello is awaited, then it is closed
        self.paused = False  # its replies back up: none of its requests are read

    # ---- the transport's callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.transport.set_write_buffer_limits(PAUSE_READING_BYTES, RESUME_READING_BYTES)
        self.table.admit(self)
        if refusal := self.access.refusal():
            self.turn_away(refusal)

    def data_received(self, data: bytes) -> None:
        self.frames.feed(data)
        self._read_frames()

    def eof_received(self) -> bool:
        if self.frames.begun() and not self.refused:
            come, due = self.frames.progress()
            self.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                            message=f"truncated frame: the stream ended after {come} of "
                                    f"{due} bytes"))
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.table.remove(self)
        self.handler.gone(self)

    def pause_writing(self) -> None:
        """Backpressure: no new requests while replies back up."""
        self.paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if not self.closed:
            self.transport.resume_reading()
            self._read_frames()

    # ---- reading ------------------------------------------------------------------------

    def _read_frames(self) -> None:
        """Every whole frame buffered, in order, until the replies back up. An oversized
        frame is answered at once and its bytes are discarded as they arrive (the framing
        stays intact, so the connection stays usable); the frame timeout bounds how long
        a begun frame may take, the hello's from the connection's first moment."""
        frames = self.frames
        limit = REFUSED_HELLO_BYTES if self.refused else self.limit
        now = self.table.now()  # one reading for the frames that came together
        with self.handler.reading():
            if not self._handle_frames(limit, now):
                return
        if frames.begun():
            if self.frame_started is None and not self.paused:
                self.frame_started = now
        elif self.greeted and self.frame_started is not None:  # a skipped frame ended
            self.frame_started = None
            self.last_active = now

    def _handle_frames(self, limit: int, now: float) -> bool:
        """False: the connection was refused and is closed; nothing more is read."""
        frames = self.frames
        while not self.paused and not self.closed:
            got = frames.next(limit)
            if got is None:
                break
            if isinstance(got, int):
                if self.refused:
                    self.close()
                    return False
                self.send(Error(id=None, code=ErrorCode.BAD_REQUEST,
                                message=f"frame of {got} bytes exceeds the limit of "
                                        f"{limit}; its bytes are skipped"))
                continue
            self.frame_started = None
            self.last_active = now
            self._handle(got)
        frames.compact()
        return True

    def _handle(self, payload: bytes | bytearray) -> None:
        if self.refused:
            self.close()  # its hello came: the refusal was the reply to it
        elif self.greeted:
            self.handler.handle_frame(self, payload)
        else:
            self.greeted = self.handler.greet(self, payload)
            if not self.greeted:
                self.close()  # after a bad hello nothing more is read

    def reaccess(self, policy: AccessPolicy) -> None:
        """A reloaded [access]: its caps apply to the requests that come next; a client
        it no longer admits is told why and closed (its requests in flight are
        cancelled, as when a client hangs up)."""
        if self.refused or self.closed:
            return
        self.access = ConnectionAccess(policy, self.peer)
        if refusal := self.access.refusal():
            self.goodbye(ErrorCode.PERMISSION_DENIED,
                         f"{refusal.message} (the daemon's config was reloaded)")

    def turn_away(self, refusal: Error) -> None:
        """Answer the client's hello with the refusal, then hang up. The client speaks
        first; waiting for its hello (bounded in bytes and time) makes the refusal the
        reply to it, where hanging up at once could reset the connection before the
        client reads."""
        self.refused = True
        self.send(refusal)
        asyncio.get_running_loop().call_later(REFUSED_HELLO_S, self.close)

    # ---- writing ------------------------------------------------------------------------

    def unsent(self) -> int:
        """Reply bytes written but not yet taken by the client's socket."""
        return self.transport.get_write_buffer_size() + self.pending_bytes

    def send(self, msg: msgspec.Struct) -> None:
        if self.closed or self.transport.is_closing():
            return
        data = frame(encoder.encode(msg))
        if self.defer is None:
            self.transport.write(data)
            self.last_active = self.table.now()
        else:
            if not self.pending:  # the turn's first reply: its time is the turn's
                self.defer(self.flush)
                self.last_active = self.table.now()
            self.pending.append(data)
            self.pending_bytes += len(data)
        self.table.note_unsent(self)

    def flush(self) -> None:
        if not self.pending:
            return
        data = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
        self.pending.clear()
        self.pending_bytes = 0
        if not self.closed and not self.transport.is_closing():
            self.transport.write(data)

    def close(self, abort: bool = False) -> None:
        if not abort:
            self.flush()  # what was said before closing still goes
        else:
            # Let go of the replies not yet written now, not when the last reference to
            # this connection goes: within one turn a result shared by many joined
            # requests would otherwise keep every dropped client's share alive at once.
            self.pending.clear()
            self.pending_bytes = 0
        if not self.closed:
            self.closed = True
            if abort:
                self.transport.abort()
            else:
                self.transport.close()
            self.table.remove(self)

    def goodbye(self, code: ErrorCode, message: str) -> None:
        """Say why, then close; at once if the client is not reading (nothing would drain)."""
        self.send(Error(id=None, code=code, message=message))
        self.flush()  # into the transport now: what it cannot take at once is not read
        self.close(abort=not self.closed and self.unsent() > 0)

    def drop(self, reason: str) -> None:
        log.warning("dropping a client: %s", reason)
        self.close(abort=True)


class ConnectionTable:
    """Every live connection: their number, their unread replies, their timeouts."""

    def __init__(self, config: DaemonConfig, fd_limit: int, now: Callable[[], float]) -> None:
        self.fd_limit = fd_limit  # the open-file limit in force: what max_connections = 0 gives
        self.follow_config(config)
        self.now = now
        self.live: set[Connection] = set()
        self.opening = 0  # accepted, not yet live
        # Unread reply bytes of all connections: exact after each sweep and each shedding,
        # an overestimate in between (a client's reads are not seen until its next reply).
        self.unsent_total = 0

    def follow_config(self, config: DaemonConfig) -> None:
        """[daemon]'s client limits (at start, and after a reload): from the next reply,
        sweep and client on. Fewer connections than are open close none: newcomers wait
        until clients leave."""
        self.max_connections = config.max_connections or auto_max_connections(self.fd_limit)
        self.max_unsent = config.max_client_buffer_bytes
        self.max_unsent_total = config.max_unread_total_bytes
        self.idle_timeout_s = config.idle_timeout_s
        self.frame_timeout_s = config.frame_timeout_s

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
