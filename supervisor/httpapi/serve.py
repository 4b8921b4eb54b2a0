"""Running the HTTP front door: uvicorn on a listening socket the supervisor bound, in a
process of its own (`python -m modelpool.supervisor.httpapi.serve FD`, its settings as
one JSON line on stdin, which stays open: each later line is the settings a reload made,
and the supervisor's end closing means it is gone; on stdout it says when it has let go
of its address, handed over) or in the supervisor's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import BinaryIO

import msgspec
import uvicorn

from modelpool.protocol import logs
from modelpool.supervisor import eventloop
from modelpool.supervisor.eventloop import EventLoop
from modelpool.supervisor.httpapi.app import Api, build_app
from modelpool.supervisor.httpapi.guard import guarded
from modelpool.supervisor.httpapi.settings import STOP_GRACE_S, HttpSettings

log = logging.getLogger("modelpool.http")
READ_LIMIT = 16 << 20  # a settings line: API keys may be many


class Server(uvicorn.Server):
    """uvicorn without its signal handlers (the process that runs it owns its signals),
    and with a stop whose bound is set, or set anew, when it is called."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self, grace_s: float | None) -> None:
        """Accept no more connections, from now; what is in flight is answered, and cut
        grace_s from now (None: however long it takes, for a front door taken over at
        a reload: the pool's timeouts bound its requests)."""
        if not self.should_exit:
            self.should_exit = True
            for server in getattr(self, "servers", ()):  # at once, not at the next tick
                server.close()
        if grace_s is not None:
            asyncio.get_running_loop().call_later(grace_s, self.cut)

    def cut(self) -> None:
        """What uvicorn's own graceful timeout does; then the lifespan's end closes the
        links to the daemon."""
        for task in list(self.server_state.tasks):
            task.cancel()
        for connection in list(self.server_state.connections):
            connection.transport.close()  # type: ignore[union-attr]


def uvicorn_server(api: Api, max_clients: int) -> Server:
    """httptools with our guards (guard.py): max_clients there, not uvicorn's
    limit_concurrency, which answers every connection 503 once that many are open; a
    request's headers bounded by body_timeout_s (of the start) like its body. No
    graceful timeout of uvicorn's: Server.stop bounds it."""
    config = uvicorn.Config(
        build_app(api), http=guarded(api.settings.body_timeout_s, max_clients),
        lifespan="on", access_log=False, log_level="warning", timeout_keep_alive=5,
        timeout_graceful_shutdown=None, server_header=False)
    return Server(config)


async def serve_in_loop(sock: socket.socket, server: Server) -> None:
    """Until cancelled (then stopped with STOP_GRACE_S) or stopped; for [http] in_loop."""
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(task)
    finally:
        if not task.done():
            server.stop(STOP_GRACE_S)
        await task


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """What the supervisor sends the front door's process."""

    settings: HttpSettings
    max_clients: int
    event_loop: EventLoop = "auto"  # the daemon's choice


async def _serve_process(sock: socket.socket, launch: Launch, let_go: BinaryIO) -> None:
    """SIGTERM stops it with STOP_GRACE_S; SIGUSR1 hands the address over to a new
    front door (a reload): it accepts no more, says so on let_go, and answers what is
    in flight however long it takes (a later SIGTERM bounds that)."""
    api = Api(launch.settings)
    server = uvicorn_server(api, launch.max_clients)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def follow_supervisor() -> None:
        while line := await reader.readline():
            try:
                api.settings = msgspec.json.decode(line, type=HttpSettings)  # a reload's
            except msgspec.DecodeError as exc:  # kept following: EOF must still end it
                log.error("settings from the supervisor not applied: %s", exc)
        server.stop(STOP_GRACE_S)  # EOF: the supervisor has gone

    def hand_over() -> None:
        server.stop(None)
        sock.close()  # the listening socket: the last of this process's hold on it
        let_go.write(b"let go\n")

    watch = loop.create_task(follow_supervisor())
    loop.add_signal_handler(signal.SIGTERM, server.stop, STOP_GRACE_S)
    loop.add_signal_handler(signal.SIGUSR1, hand_over)
    try:
        await server.serve(sockets=[sock])
    finally:
        watch.cancel()


def main(argv: list[str]) -> int:
    # Unbuffered: what a buffered read took beyond this line (a reload's settings
    # written at once) would never reach the loop's reader of the same pipe.
    launch = msgspec.json.decode(sys.stdin.buffer.raw.readline(), type=Launch)
    logs.configure_from_env()  # the daemon's log format, as its workers use it
    sock = socket.socket(fileno=int(argv[0]))
    # Standard output is the supervisor's pipe for "let go" alone: anything printed
    # goes to standard error instead.
    let_go = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(_serve_process(sock, launch, let_go), launch.event_loop)
    return eventloop.exit_without_teardown(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
