"""Helpers of the adversarial suite: real daemons through the integration suite's
conftest, raw sockets, the supervisor's memory.

pytest imports every folder's conftest.py as the module `conftest`, one replacing the
other (and when several folders are named on the command line, the last one's stays for
all), so the integration conftest is loaded here by path under its own name, and the
tests import this module by its unique name. The folder's conftest.py only hands the
integration fixtures (make_daemon, tiny_llm_dir) to pytest from here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import resource
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil

from modelpool.protocol.framing import HEADER, recv_frame, send_frame
from modelpool.protocol.messages import Hello, encoder
from modelpool.protocol.wire import server_decoder

_PATH = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
_spec = importlib.util.spec_from_file_location("_modelpool_integration_conftest", _PATH)
assert _spec is not None and _spec.loader is not None
_integration = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _integration  # its dataclass looks itself up there
_spec.loader.exec_module(_integration)

ROOT = _integration.ROOT
Daemon = _integration.Daemon
MakeDaemon = _integration.MakeDaemon
daemon_env = _integration.daemon_env
fresh_socket_path = _integration.fresh_socket_path
model_entry = _integration.model_entry
start_daemon = _integration.start_daemon
wait_for_socket = _integration.wait_for_socket
OTHER_GID = _integration.OTHER_GID
OTHER_UID = _integration.OTHER_UID
as_other_user = _integration.as_other_user
other_user_env = _integration.other_user_env
make_daemon = _integration.make_daemon  # a fixture: conftest.py hands it to pytest
tiny_llm_dir = _integration.tiny_llm_dir


@contextlib.contextmanager
def running_daemon(workdir: Path, config_toml: str) -> Iterator[Daemon]:
    """A daemon serving config_toml, stopped (and its processes killed) on exit."""
    yield from _stopped_after(start_daemon(workdir, config_toml))


@contextlib.contextmanager
def fd_limited_daemon(workdir: Path, config_toml: str, nofile: int) -> Iterator[Daemon]:
    """A daemon started under RLIMIT_NOFILE = nofile (soft and hard)."""
    socket_path = fresh_socket_path()
    config = workdir / "modelpool.toml"
    config.write_text(textwrap.dedent(config_toml))
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "modelpool.supervisor.cli", "--socket", socket_path, "serve",
             "--config", str(config)],
            cwd=ROOT, env=daemon_env(socket_path), stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    daemon = Daemon(process, socket_path, log_path)
    wait_for_socket(daemon, 30)
    yield from _stopped_after(daemon)


def _stopped_after(daemon: Daemon) -> Iterator[Daemon]:
    try:
        yield daemon
    finally:
        try:
            daemon.stop()
        finally:
            for child in daemon.descendants():
                child.kill()


def raw_connection(socket_path: str, timeout_s: float = 30) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(socket_path)
    return sock


def greeted(socket_path: str, timeout_s: float = 30) -> socket.socket:
    sock = raw_connection(socket_path, timeout_s)
    send_frame(sock, encoder.encode(Hello(protocol_version=1)))
    assert type(reply(sock)).__name__ == "Welcome"
    return sock


def reply(sock: socket.socket) -> Any:
    return server_decoder.decode(recv_frame(sock))


def send_raw(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(HEADER.pack(len(payload)) + payload)


def send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    send_frame(sock, encoder.encode(msg))


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def closed_within(sock: socket.socket, timeout_s: float) -> tuple[list[Any], float | None]:
    """Read replies until the daemon closes the connection: (replies, seconds) or
    (replies, None) if it is still open after timeout_s."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    got: list[Any] = []
    try:
        while True:
            got.append(reply(sock))
    except (EOFError, ConnectionError):
        return got, time.monotonic() - start
    except TimeoutError:
        return got, None
