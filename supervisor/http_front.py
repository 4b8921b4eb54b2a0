"""The HTTP front door's place in the daemon: the config checked and the port bound at
start (a bad address or a taken port stops the start, before anything else), then the
front door served by a process of its own, started again if it dies, and stopped last.

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
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from modelpool.supervisor.config import Config, ConfigError, HttpConfig
from modelpool.supervisor.httpapi.settings import HttpSettings

if TYPE_CHECKING:
    from modelpool.supervisor.httpapi.app import Api

log = logging.getLogger("modelpool.http")
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


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
        max_priority=http.max_priority, default_models=default_models or {})


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
    sock.set_inheritable(True)
    return sock


class HttpFront:
    def __init__(self, config: Config, socket_path: str,
                 default_models: dict[str, str]) -> None:
        self.config = config.http
        self.event_loop = config.daemon.event_loop
        self.max_frame_bytes = config.daemon.max_frame_bytes  # the body cap's default
        self.settings = settings_of(config, socket_path, default_models)
        self.sock = bind(self.config.listen)
        self.process: asyncio.subprocess.Process | None = None
        self.api: Api | None = None  # in_loop: the front door's own, in this process
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
            from modelpool.supervisor.httpapi.serve import serve_in_loop

            self.api = Api(self.settings)
            await serve_in_loop(self.sock, self.api, self.config.max_clients)
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

    def settings_for(self, config: Config) -> HttpSettings:
        """What a reload's [http] makes of the settings: its keys (api_key_file read
        again) and the limits of a request; the rest stays as started. The keys are
        checked against the new address (would the config start?) and the one served
        now."""
        http = config.http
        keys = api_keys(http)
        check_keys(http.listen, keys)
        check_keys(self.config.listen, keys)
        return msgspec.structs.replace(
            self.settings, api_keys=keys, metrics_need_key=http.metrics_need_key,
            max_body_bytes=http.max_body_bytes or self.max_frame_bytes,
            max_priority=http.max_priority)

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
            stdin=asyncio.subprocess.PIPE, pass_fds=(fd,))
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(Launch(
            settings=self.settings, max_clients=self.config.max_clients,
            event_loop=self.event_loop)) + b"\n")
        return await self.process.wait()

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.stopping = True
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        self.sock.close()
