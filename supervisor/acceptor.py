"""Accepting clients on the listening socket, within the process's file descriptors.

asyncio's own accept loop, out of file descriptors, logs a traceback for every failed
accept (up to 100 per wake-up) and schedules a retry for each, so the retries pile up:
600 idle clients under a 512-fd limit wrote 680,000 log lines in 20 s. Here the daemon
raises its soft fd limit to the hard one at start, keeps the number of connections
under that limit with a reserve for worker pipes (extra clients are accepted, told
OVERLOADED and closed), and if accepting still fails it pauses accepting for a moment
and logs at most one line per ACCEPT_LOG_EVERY_S.

A refused client is answered once its hello has come (or after REFUSE_GRACE_S): closed
any sooner, its own send of the hello would fail (a Unix socket refuses writes to a
closed peer) and it would never read why. At most MAX_REFUSING wait at once, within the
fd reserve; beyond that a refused client is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
from collections.abc import Callable

from modelpool.supervisor.clock import Scheduler, Timer

log = logging.getLogger("modelpool.server")

ACCEPT_BATCH = 16  # accepts per wake-up, so a connection storm cannot hog the loop
ACCEPT_RETRY_S = 0.5  # after a failed accept (out of fds, memory)
ACCEPT_LOG_EVERY_S = 10.0
REFUSE_GRACE_S = 0.5
MAX_REFUSING = 32
MIN_FD_RESERVE = 128  # fds kept for worker pipes, sentinels, shared memory, logs
MAX_AUTO_CONNECTIONS = 4096


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def auto_max_connections(fd_limit: int) -> int:
    """Connections allowed by an fd limit: a quarter (at least MIN_FD_RESERVE) is kept for
    workers and the daemon's own files."""
    reserve = max(MIN_FD_RESERVE, fd_limit // 4)
    return max(1, min(MAX_AUTO_CONNECTIONS, fd_limit - reserve))


class Acceptor:
    """Accepts clients and hands each to on_client, which says whether it had room; a
    client without room is sent refusal() and closed."""

    def __init__(self, sock: socket.socket, scheduler: Scheduler,
                 on_client: Callable[[socket.socket], bool],
                 refusal: Callable[[], bytes]) -> None:
        self.sock = sock
        self.scheduler = scheduler
        self.on_client = on_client
        self.refusal = refusal
        self.refusing = 0
        self._retry: Timer | None = None
        self._failures_unlogged = 0
        self._last_logged: float | None = None
        self._closed = False

    def start(self) -> None:
        self._retry = None
        if not self._closed:
            asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            if self._retry is not None:
                self._retry.cancel()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                self._note_failure(exc)
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
                self._retry = self.scheduler.call_later(ACCEPT_RETRY_S, self.start)
                return
            conn.setblocking(False)
            if not self.on_client(conn):
                self._refuse(conn)

    def _refuse(self, conn: socket.socket) -> None:
        if self.refusing >= MAX_REFUSING:
            conn.close()
            return
        self.refusing += 1
        loop = asyncio.get_running_loop()
        timer: Timer | None = None

        def answer() -> None:
            if conn.fileno() == -1:
                return  # answered already
            loop.remove_reader(conn.fileno())
            if timer is not None:
                timer.cancel()
            with contextlib.suppress(OSError):
                conn.recv(1 << 16)  # the hello, unread: closing over it would reset the peer
            with contextlib.suppress(OSError):
                conn.send(self.refusal())  # tiny: fits any socket buffer
            conn.close()
            self.refusing -= 1

        loop.add_reader(conn.fileno(), answer)  # the hello (or the client's end) arrives
        timer = self.scheduler.call_later(REFUSE_GRACE_S, answer)

    def _note_failure(self, exc: OSError) -> None:
        now = self.scheduler.now()
        if self._last_logged is not None and now - self._last_logged < ACCEPT_LOG_EVERY_S:
            self._failures_unlogged += 1
            return
        more = (f" ({self._failures_unlogged} more since the last report)"
                if self._failures_unlogged else "")
        log.error("cannot accept clients: %s; retrying every %g s%s", exc.strerror or exc,
                  ACCEPT_RETRY_S, more)
        self._last_logged = now
        self._failures_unlogged = 0
