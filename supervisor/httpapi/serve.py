"""Running the HTTP front door: uvicorn on a listening socket the supervisor bound, in a
process of its own (`python -m modelpool.supervisor.httpapi.serve FD`, its settings as
one JSON line on stdin, which stays open: each later line is the settings a reload made,
and the supervisor's end closing means it is gone) or in the supervisor's own loop."""

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
from modelpool.supervisor.httpapi.app import Api, build_app
from modelpool.supervisor.httpapi.guard import guarded
from modelpool.supervisor.httpapi.settings import HttpSettings

log = logging.getLogger("modelpool.http")
READ_LIMIT = 16 << 20  # a settings line: API keys may be many


class Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process that runs it owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_server(api: Api, max_clients: int) -> Server:
    """httptools with our guards (guard.py): max_clients there, not uvicorn's
    limit_concurrency, which answers every connection 503 once that many are open; a
    request's headers bounded by body_timeout_s (of the start) like its body."""
    config = uvicorn.Config(
        build_app(api), http=guarded(api.settings.body_timeout_s, max_clients),
        lifespan="on", access_log=False, log_level="warning", timeout_keep_alive=5,
        timeout_graceful_shutdown=5, server_header=False)
    return Server(config)


async def serve_in_loop(sock: socket.socket, api: Api, max_clients: int) -> None:
    """Until cancelled; for [http] in_loop."""
    server = uvicorn_server(api, max_clients)
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
        server.should_exit = True  # EOF: the supervisor has gone

    watch = loop.create_task(follow_supervisor())
    loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
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
    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(_serve_process(sock, launch), launch.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
