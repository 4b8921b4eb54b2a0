"""The daemon as systemd runs it, with real processes: the notify protocol on a real
datagram socket (READY once the socket accepts, WATCHDOG at its rate and none while the
loop is stopped, RELOADING then READY on SIGHUP, STOPPING on SIGTERM), socket activation
with a passed fd 3, journald and JSON log lines, and a stop without the resource
tracker's warning."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, Daemon, daemon_env, fresh_socket_path

from modelpool.protocol.client import Client
from modelpool.protocol.framing import recv_frame, send_frame
from modelpool.protocol.messages import Hello, encoder
from modelpool.protocol.wire import server_decoder

WATCHDOG_USEC = 400_000  # WatchdogSec=0.4s: WATCHDOG=1 every 0.2 s
SERVE = [sys.executable, "-m", "modelpool.supervisor.cli"]
# Execs argv with the socket of fd argv[1] as fd 3 and LISTEN_PID set to its own pid,
# which exec keeps: what systemd does for a .socket unit's service.
AS_ACTIVATED = textwrap.dedent("""
    import os, sys
    fd = int(sys.argv[1])
    os.dup2(fd, 3)
    os.close(fd)
    os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()),
                      LISTEN_FDNAMES="modelpool.socket")
    os.execv(sys.argv[2], sys.argv[2:])
""")


class NotifyListener:
    """systemd's end of NOTIFY_SOCKET: every datagram, with when it came, read at once
    by a thread (a datagram socket holds only ~10 unread)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.05)
        self.received: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            now = time.monotonic()
            self.received += [(now, field) for field in data.split("\n")]

    def wait_for(self, field: str, timeout_s: float, since: float = 0.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for when, seen in list(self.received):
                if seen == field and when >= since:
                    return when
            time.sleep(0.01)
        raise AssertionError(f"no {field} within {timeout_s}s: {self.fields()}")

    def fields(self, since: float = 0.0, until: float = float("inf")) -> list[str]:
        return [field for when, field in list(self.received) if since <= when <= until]

    def times(self, field: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [when for when, seen in list(self.received)
                if seen == field and since <= when <= until]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short directory (Unix socket paths are limited to ~107 bytes)."""
    path = Path(fresh_socket_path()).parent
    path.mkdir(mode=0o700)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def spawn(workdir: Path, argv: list[str], env: dict[str, str], config: str = "",
          pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen[bytes], Path]:
    """The daemon, its stderr (the log) in workdir/daemon.log."""
    (workdir / "modelpool.toml").write_text(textwrap.dedent(config))
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*argv, "serve", "--config", str(workdir / "modelpool.toml")], cwd=ROOT,
            env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds)
    return process, log_path


def stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def children_environments(pid: int) -> list[str]:
    environs = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(OSError):  # exited meanwhile
            environs.append(Path(f"/proc/{child.pid}/environ").read_bytes().decode())
    return environs


def test_ready_watchdog_and_stopping_as_systemd_sees_them(workdir: Path) -> None:
    listener = NotifyListener(str(workdir / "notify"))
    socket_path = str(workdir / "mp.sock")
    log_path = workdir / "daemon.log"
    log_path.touch()
    st = os.stat(log_path)  # the daemon's stderr: journald's stream, as far as it can tell
    env = {**daemon_env(socket_path), "NOTIFY_SOCKET": listener.path,
           "WATCHDOG_USEC": str(WATCHDOG_USEC), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    process, log_path = spawn(workdir, [*SERVE, "--socket", socket_path], env)
    try:
        ready_at = listener.wait_for("READY=1", 60)
        # READY only once the socket accepts: a client is served the moment it comes.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(socket_path)
        with Client(socket_path=socket_path, timeout_s=10) as client:
            assert client.status()["pid"] == process.pid
        assert any(f.startswith("STATUS=0 model(s) loaded") for f in listener.fields())
        # WATCHDOG=1 at half of WATCHDOG_USEC, from the loop: 2 s of it.
        time.sleep(2.5)
        window = (ready_at + 0.5, ready_at + 2.5)
        beats = listener.times("WATCHDOG=1", *window)
        assert 6 <= len(beats) <= 11, beats
        gaps = sorted(b - a for a, b in itertools.pairwise(beats))
        assert 0.15 <= gaps[len(gaps) // 2] <= 0.3, gaps
        # A stopped (wedged) loop sends nothing; once it runs again, it beats again.
        os.kill(process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(1.0)
        resumed_at = time.monotonic()
        os.kill(process.pid, signal.SIGCONT)
        assert listener.times("WATCHDOG=1", stopped_at + 0.1, resumed_at) == []
        assert listener.wait_for("WATCHDOG=1", 5, since=resumed_at) - resumed_at < 5
        # systemctl reload (ExecReload: SIGHUP): RELOADING=1, then READY=1 once applied.
        reload_at = time.monotonic()
        os.kill(process.pid, signal.SIGHUP)
        reloaded_at = listener.wait_for("READY=1", 30, since=reload_at)
        assert listener.times("RELOADING=1", reload_at, reloaded_at)
        assert any(f.startswith("MONOTONIC_USEC=")
                   for f in listener.fields(reload_at, reloaded_at))
        # Nothing of systemd's reaches the forkserver and the workers.
        environs = children_environments(process.pid)
        assert environs and not [e for e in environs if "NOTIFY_SOCKET" in e
                                 or "WATCHDOG_USEC" in e]
        stop_at = time.monotonic()
        assert stop(process) == 0
        after = listener.fields(since=stop_at)
        assert "STOPPING=1" in after
        assert any(f.startswith("EXTEND_TIMEOUT_USEC=") for f in after)
    finally:
        stop(process)
        listener.close()
    lines = log_path.read_text().splitlines()
    assert "<6>INFO modelpool.server: stopping: refusing new work, draining" in lines
    assert "<6>INFO modelpool.server: config reloaded: no change" in lines
    assert all(re.match(r"<[0-7]>", line) for line in lines), lines  # journald priorities
    assert not [line for line in lines if re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", line)]


def test_socket_activation_serves_the_passed_socket(workdir: Path) -> None:
    path = str(workdir / "activated.sock")
    unused = str(workdir / "never-bound.sock")
    systemd_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    systemd_socket.bind(path)
    systemd_socket.listen(16)
    # A client comes before the daemon runs: it waits in the socket's queue.
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.settimeout(60)
    early.connect(path)
    send_frame(early, encoder.encode(Hello(protocol_version=1)))
    wrapper = [sys.executable, "-c", AS_ACTIVATED, str(systemd_socket.fileno())]
    process, log_path = spawn(
        workdir, [*wrapper, *SERVE, "--socket", unused], daemon_env(unused),
        config='[daemon]\nlog_format = "json"\n', pass_fds=(systemd_socket.fileno(),))
    try:
        assert type(server_decoder.decode(recv_frame(early))).__name__ == "Welcome"
        with Client(socket_path=path, timeout_s=30) as client:
            status = client.status()
        assert status["pid"] == process.pid and status["socket"] == path
        assert not os.path.exists(unused)
        assert stop(process) == 0
        # The path is systemd's: left in place, and still listening for the next start.
        assert os.path.exists(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as later:
            later.connect(path)
    finally:
        stop(process)
        early.close()
        systemd_socket.close()
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {"time", "level", "logger", "pid", "message"} <= set(entries[0])
    assert any(e["message"] == f"serving the socket passed by systemd: {path}"
               for e in entries)


def test_several_passed_sockets_are_refused_in_one_line(workdir: Path) -> None:
    env = {**daemon_env(str(workdir / "s.sock")), "LISTEN_FDS": "2"}
    run = subprocess.run(["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", *SERVE, "serve"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "modelpool: 2 sockets were passed (LISTEN_FDS); modelpool serves one: give its "
        ".socket unit a single ListenStream="]


def test_no_resource_tracker_warning_at_stop(make_daemon: object,
                                             tiny_models_dir: Path) -> None:
    """Making an image used to leave a semaphore registered (tqdm's lock, in a worker
    that leaves with os._exit), and the resource tracker warned of it at every stop."""
    daemon: Daemon = make_daemon(f"""
        [[models]]
        key = "tiny-sd"
        capability = "text_to_image"
        path = "{tiny_models_dir / 'tiny-sd'}"
    """)  # type: ignore[operator]
    with daemon.client() as c:
        chunks = list(c.generate_image("a cat", model="tiny-sd", steps=2, width=64,
                                       height=64, seed=1))
    assert chunks[-1].png
    assert daemon.stop() == 0
    time.sleep(0.5)  # the tracker writes its warning as it exits, after the daemon
    assert "leaked" not in daemon.log() and "resource_tracker" not in daemon.log()
