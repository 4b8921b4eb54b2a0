"""Running the HTTP front door: uvicorn on a listening socket the supervisor bound, in a
process of its own (`python -m modelpool.supervisor.httpapi.serve FD`, its settings as
one JSON line on stdin, which stays open: the supervisor's end closing means it is gone)
or in the supervisor's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator

import msgspec
import uvicorn

from modelpool.protocol import logs
from modelpool.supervisor import eventloop
from modelpool.supervisor.eventloop import EventLoop
from modelpool.supervisor.httpapi.app import build_app
from modelpool.supervisor.httpapi.guard import guarded
from modelpool.supervisor.httpapi.settings import HttpSettings

log = logging.getLogger("modelpool.http")


class Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process that runs it owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_server(settings: HttpSettings, max_clients: int) -> Server:
    """httptools with our guards (guard.py): max_clients there, not uvicorn's
    limit_concurrency, which answers every connection 503 once that many are open; a
    request's headers bounded by body_timeout_s like its body."""
    config = uvicorn.Config(
        build_app(settings), http=guarded(settings.body_timeout_s, max_clients),
        lifespan="on", access_log=False, log_level="warning", timeout_keep_alive=5,
        timeout_graceful_shutdown=5, server_header=False)
    return Server(config)


async def serve_in_loop(sock: socket.socket, settings: HttpSettings,
                        max_clients: int) -> None:
    """Until cancelled; for [http] in_loop."""
    server = uvicorn_server(settings, max_clients)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(task)
    finally:
        server.should_exit = True
        await task


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """What the supervisor sends the front door's process."""

    settings: HttpSettings
    max_clients: int
    event_loop: EventLoop = "auto"  # the daemon's choice


async def _serve_process(sock: socket.socket, launch: Launch) -> None:
    server = uvicorn_server(launch.settings, launch.max_clients)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def orphaned() -> None:
        await reader.read()  # EOF: the supervisor has gone
        server.should_exit = True

    watch = loop.create_task(orphaned())
    loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
    try:
        await server.serve(sockets=[sock])
    finally:
        watch.cancel()


def main(argv: list[str]) -> int:
    launch = msgspec.json.decode(sys.stdin.buffer.readline(), type=Launch)
    logs.configure_from_env()  # the daemon's log format, as its workers use it
    sock = socket.socket(fileno=int(argv[0]))
    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(_serve_process(sock, launch), launch.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
