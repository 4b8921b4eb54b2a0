"""The HTTP front door's place in the daemon: the config checked and the port bound at
start (a bad address or a taken port stops the start, before anything else), then the
front door served by a process of its own, started again if it dies, and stopped last.
A reload that moves its address or changes what it starts with hands over to a new
front door (`HttpDoor`), so the loaded models stay.

A process of its own because HTTP parsing, JSON and TLS-terminating proxies' clients
cost CPU per request that the supervisor's loop must not pay: a flood of HTTP requests
waits there, not in front of socket clients. It reaches the pool through the socket like
any client, so admission, fairness and cancellation are the socket's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from modelpool.supervisor.config import Config, ConfigError, HttpConfig
from modelpool.supervisor.httpapi.settings import STOP_GRACE_S, HttpSettings

if TYPE_CHECKING:
    from modelpool.supervisor.httpapi.app import Api
    from modelpool.supervisor.httpapi.serve import Server

log = logging.getLogger("modelpool.http")
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
# What a front door keeps from its start: a reload that changes one of them starts a new
# front door, which takes over the address (the same socket, or one bound anew).
STARTED_WITH = ("listen", "connections", "max_clients", "in_loop", "body_timeout_s",
                "kept_responses_mib")


def listen_address(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"[http] listen = {listen!r}: expected HOST:PORT "
                          "(e.g. 127.0.0.1:8000, [::1]:8000)")
    return host.strip("[]") or "127.0.0.1", int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys(http: HttpConfig) -> list[str]:
    keys = list(http.api_keys)
    if http.api_key_file:
        try:
            text = Path(http.api_key_file).read_text()
        except OSError as exc:
            raise ConfigError(f"[http] api_key_file {http.api_key_file}: "
                              f"{exc.strerror}") from None
        keys += [line.strip() for line in text.splitlines()
                 if line.strip() and not line.startswith("#")]
    return keys


def check_keys(listen: str, keys: list[str]) -> None:
    """An open port beyond loopback without keys refuses to start (or to reload)."""
    host, _ = listen_address(listen)
    if not keys and not is_loopback(host):
        raise ConfigError(f"[http] listen = {listen!r} is reachable beyond this "
                          "machine: set api_keys or api_key_file, or listen on 127.0.0.1")


def settings_of(config: Config, socket_path: str,
                default_models: dict[str, str] | None = None) -> HttpSettings:
    """Checked (check_keys)."""
    http = config.http
    keys = api_keys(http)
    check_keys(http.listen, keys)
    return HttpSettings(
        socket_path=socket_path, api_keys=keys, metrics_need_key=http.metrics_need_key,
        max_body_bytes=http.max_body_bytes or config.daemon.max_frame_bytes,
        body_timeout_s=http.body_timeout_s, connections=http.connections,
        max_priority=http.max_priority, prefix_cache_per_key=http.prefix_cache_per_key,
        requests_per_minute=http.requests_per_minute,
        kept_responses_bytes=http.kept_responses_mib * 2**20,
        kept_responses_postgres=config.cluster.dsn, default_models=default_models or {})


def bind(listen: str) -> socket.socket:
    host, port = listen_address(listen)
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise ConfigError(f"[http] listen = {listen!r}: {exc.strerror}") from None
    # Accepted connections inherit it: a response's headers and body, written apart, must
    # not wait for the client's delayed ACK (40 ms on a kept-alive connection).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Not inheritable: the front door's process gets it by pass_fds. uvloop's subprocesses
    # inherit every inheritable descriptor (it does not close them), so an export process
    # or a later front door would keep the address open after its front door stopped.
    return sock


class HttpFront:
    def __init__(self, config: Config, socket_path: str, default_models: dict[str, str],
                 sock: socket.socket | None = None) -> None:
        """sock: the listening socket, when one is already bound to config's address."""
        self.config = config.http
        self.event_loop = config.daemon.event_loop
        self.max_frame_bytes = config.daemon.max_frame_bytes  # the body cap's default
        self.settings = settings_of(config, socket_path, default_models)
        self.sock = sock if sock is not None else bind(self.config.listen)
        self.process: asyncio.subprocess.Process | None = None
        self.api: Api | None = None  # in_loop: the front door's own, in this process
        self.server: Server | None = None  # in_loop: its uvicorn
        self.stopping = False

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def run(self, socket_path: str) -> None:
        """Serve until cancelled; socket_path: the daemon's, as it serves it (systemd
        may have passed another than the config's)."""
        self.settings = msgspec.structs.replace(self.settings, socket_path=socket_path)
        if self.config.in_loop:
            from modelpool.supervisor.httpapi.app import Api
            from modelpool.supervisor.httpapi.serve import serve_in_loop, uvicorn_server

            self.api = Api(self.settings)
            self.server = uvicorn_server(self.api, self.config.max_clients)
            await serve_in_loop(self.sock, self.server)
            return
        failures = 0
        while not self.stopping:
            code = await self._run_process()
            if self.stopping:
                return
            delay = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
            failures += 1
            log.warning("the HTTP front door exited (%s); starting it again in %.1fs",
                        code, delay)
            await asyncio.sleep(delay)

    def keeps(self, config: Config) -> bool:
        """Would this front door serve config as it is (STARTED_WITH, and the frame cap
        its links to the daemon were told when they connected)?"""
        return (all(getattr(self.config, f) == getattr(config.http, f) for f in STARTED_WITH)
                and self.max_frame_bytes == config.daemon.max_frame_bytes)

    def settings_for(self, config: Config) -> HttpSettings:
        """What a reload's [http] makes of this front door's settings, when it keeps
        what it started with (STARTED_WITH): its keys (api_key_file read again, and
        checked as at start), the limits of a request and its clients' requests a
        minute."""
        http = config.http
        keys = api_keys(http)
        check_keys(http.listen, keys)
        return msgspec.structs.replace(
            self.settings, api_keys=keys, metrics_need_key=http.metrics_need_key,
            max_body_bytes=http.max_body_bytes or self.max_frame_bytes,
            max_priority=http.max_priority, prefix_cache_per_key=http.prefix_cache_per_key,
            requests_per_minute=http.requests_per_minute)

    def apply(self, settings: HttpSettings) -> None:
        """At once, for the next request; a front door started again starts with them."""
        self.settings = settings
        if self.api is not None:
            self.api.settings = settings
        elif self.process is not None and self.process.returncode is None:
            assert self.process.stdin is not None
            self.process.stdin.write(msgspec.json.encode(settings) + b"\n")

    async def _run_process(self) -> int:
        from modelpool.supervisor.httpapi.serve import Launch

        fd = self.sock.fileno()
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "modelpool.supervisor.httpapi.serve", str(fd),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, pass_fds=(fd,))
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(Launch(
            settings=self.settings, max_clients=self.config.max_clients,
            event_loop=self.event_loop)) + b"\n")
        return await self.process.wait()

    async def hand_over(self, timeout_s: float = 5.0) -> None:
        """A new front door takes over: this one lets go of its address (by the time
        this returns) and answers what it has in flight, however long that takes (the
        pool's timeouts bound it); its run() ends when it is done."""
        self.stopping = True
        process = self.process
        if self.server is not None:
            self.server.stop(None)
        elif process is not None and process.returncode is None:
            assert process.stdout is not None
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGUSR1)
                with contextlib.suppress(TimeoutError):  # else it is gone, or hung
                    await asyncio.wait_for(process.stdout.readline(), timeout_s)
        self.sock.close()

    async def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """Requests in flight get timeout_s to finish. The address is let go at once:
        the process, told to stop, accepts no more, and this process's socket would
        only queue connections that nobody takes."""
        self.stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        else:
            process = None  # none, or already gone
        self.sock.close()
        if process is None:
            return
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


@dataclass
class HttpReload:
    """What a reload makes of the front door, worked out (and a new address bound)
    before anything changes, so that a config that would not start changes nothing."""

    settings: HttpSettings | None = None  # the kept front door's, when they changed
    front: HttpFront | None = None  # a new front door, bound: added, or taking over
    stop: bool = False  # the running one goes (taken over, or listen removed)

    @property
    def changed(self) -> bool:
        return self.settings is not None or self.front is not None or self.stop


class HttpDoor:
    """The daemon's HTTP front door across reloads: none, or one HttpFront serving. A
    new one takes over before the old one stops; on the same address they share the
    listening socket meanwhile, so a client that connects then is served by either."""

    def __init__(self, config: Config, socket_path: str,
                 default_models: dict[str, str]) -> None:
        self.socket_path = socket_path
        self.front = (HttpFront(config, socket_path, default_models)
                      if config.http.listen else None)
        self._task: asyncio.Task[None] | None = None
        # Front doors taken over, answering what they had in flight: until they are done.
        self._handed_over: dict[asyncio.Task[None], HttpFront] = {}

    def start(self, socket_path: str) -> None:
        """socket_path: the daemon's, as it serves it (systemd may have passed another)."""
        self.socket_path = socket_path
        if self.front is not None:
            self._task = asyncio.get_running_loop().create_task(self.front.run(socket_path))
            log.info("HTTP API on http://%s", self.front.address)

    def reloaded(self, config: Config, default_models: dict[str, str]) -> HttpReload:
        """ConfigError, with nothing bound, if the config's [http] would not start."""
        front, http = self.front, config.http
        if not http.listen:
            return HttpReload(stop=front is not None)
        if front is not None and front.keeps(config):
            settings = front.settings_for(config)
            return HttpReload(settings=settings if settings != front.settings else None)
        sock = None
        if front is not None and front.config.listen == http.listen:
            sock = front.sock.dup()  # its own descriptor: each front door closes its own
        try:
            return HttpReload(front=HttpFront(config, self.socket_path, default_models, sock),
                              stop=front is not None)
        except BaseException:
            if sock is not None:
                sock.close()
            raise

    def discard(self, reload: HttpReload) -> None:
        """The reload was refused after all: let go of what it bound."""
        if reload.front is not None:
            reload.front.sock.close()

    async def apply(self, reload: HttpReload, default_models: dict[str, str]) -> None:
        """The reload's front door, answering with the default models of now."""
        old, old_task = self.front, self._task
        if reload.front is None and not reload.stop:
            if old is not None:
                settings = msgspec.structs.replace(reload.settings or old.settings,
                                                   default_models=default_models)
                if settings != old.settings:
                    old.apply(settings)
            return
        self.front, self._task = reload.front, None
        if reload.front is not None:
            reload.front.settings = msgspec.structs.replace(
                reload.front.settings, default_models=default_models)
            self.start(self.socket_path)
        if old is None:
            return
        if reload.front is None:  # [http] listen removed
            await _stop(old, old_task)
            return
        await old.hand_over()
        if old_task is not None and not old_task.done():
            self._handed_over[old_task] = old
            old_task.add_done_callback(self._handed_over.pop)

    async def stop(self) -> None:
        """Last: HTTP clients got their answers while the pool drained."""
        fronts = list(self._handed_over.items())
        if self.front is not None:
            fronts.append((self._task, self.front))
            self.front = self._task = None
        await asyncio.gather(*(_stop(front, task) for task, front in fronts))


async def _stop(front: HttpFront, task: asyncio.Task[None] | None) -> None:
    if task is not None:  # first: served from this loop (in_loop), it stops serving
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await front.stop()
