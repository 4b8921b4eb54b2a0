"""Daemon lifecycle with real processes: socket safety, hostile frames, stop and drain,
dead workers."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import psutil
import pytest
from conftest import ROOT, Daemon, daemon_env, fresh_socket_path, model_entry, wait_for_socket

from modelpool.protocol.client import PoolError, TextChunk
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import HEADER, recv_frame, send_frame
from modelpool.protocol.messages import Embed, Embeddings, Error, Hello, encoder
from modelpool.protocol.wire import server_decoder

MakeDaemon = Callable[[str], Daemon]


def raw_connection(daemon: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(daemon.socket_path)
    return sock


def handshake(sock: socket.socket) -> None:
    send_frame(sock, encoder.encode(Hello(protocol_version=1)))
    assert type(server_decoder.decode(recv_frame(sock))).__name__ == "Welcome"


def reply(sock: socket.socket) -> object:
    return server_decoder.decode(recv_frame(sock))


def test_socket_is_private_and_a_live_one_is_never_replaced(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(model_entry("slow", run_s=0, max_workers=1))
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o600
    second = subprocess.run(
        [sys.executable, "-m", "modelpool.supervisor.cli", "--socket", daemon.socket_path, "serve"],
        cwd=ROOT, env=daemon_env(daemon.socket_path), capture_output=True, timeout=60)
    assert second.returncode == 1 and b"another daemon" in second.stderr
    with daemon.client() as c:
        assert c.embed("abc", model="slow").shape == (8,)  # the first one still serves


def test_stale_socket_is_replaced(make_daemon: MakeDaemon) -> None:
    path = fresh_socket_path()
    os.makedirs(os.path.dirname(path), mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays and nobody listens: what a crashed daemon leaves
    daemon = make_daemon(model_entry("slow", run_s=0, max_workers=1), socket_path=path)
    with daemon.client() as c:
        assert c.embed("abc", model="slow").shape == (8,)


def test_a_non_socket_file_is_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "not-a-socket"
    path.write_text("precious")
    run = subprocess.run(
        [sys.executable, "-m", "modelpool.supervisor.cli", "--socket", str(path), "serve"],
        cwd=ROOT, env=daemon_env(str(path)), capture_output=True, timeout=60)
    assert run.returncode == 1 and b"not a socket" in run.stderr
    assert path.read_text() == "precious"


def test_hostile_frames_get_bad_request_and_the_daemon_keeps_serving(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[daemon]\nmax_frame_bytes = 4096\n"
                         + model_entry("slow", run_s=0, max_workers=1))
    with raw_connection(daemon) as sock:
        handshake(sock)
        send_frame(sock, b"\xc1 not msgpack")
        err = reply(sock)
        assert isinstance(err, Error) and err.code is ErrorCode.BAD_REQUEST and err.id is None
        send_frame(sock, msgspec.msgpack.encode({"op": "embed", "id": 5, "texts": []}))
        err = reply(sock)
        assert isinstance(err, Error) and err.code is ErrorCode.BAD_REQUEST and err.id == 5
        sock.sendall(HEADER.pack(10_000) + b"x" * 10_000)
        err = reply(sock)
        assert isinstance(err, Error) and "exceeds" in err.message
        send_frame(sock, encoder.encode(Embed(id=6, model="slow", texts=["still here"])))
        ok = reply(sock)
        assert isinstance(ok, Embeddings) and ok.id == 6
        sock.sendall(HEADER.pack(100) + b"x" * 10)
        sock.shutdown(socket.SHUT_WR)
        err = reply(sock)
        assert isinstance(err, Error) and "truncated" in err.message
    with raw_connection(daemon) as sock:
        send_frame(sock, encoder.encode(Hello(protocol_version=999)))
        err = reply(sock)
        assert isinstance(err, Error) and err.code is ErrorCode.PROTOCOL_VERSION
    with daemon.client() as c:
        assert c.embed("after all that", model="slow").shape == (8,)


def test_stop_leaves_no_process_and_no_socket(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(model_entry("slow", run_s=0, max_workers=1))
    with daemon.client() as c:
        c.embed("x", model="slow")
        processes = daemon.descendants()
        assert len(processes) >= 2  # the forkserver and at least one worker
        assert c.stop() == "stopping"
    assert daemon.process.wait(20) == 0
    assert not os.path.exists(daemon.socket_path)
    _gone, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, alive


def _stream_in_thread(daemon: Daemon, max_tokens: int, out: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            with daemon.client() as c:
                out.extend(c.generate("go", model="counter", max_tokens=max_tokens))
        except PoolError as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_running(daemon: Daemon, key: str, count: int) -> None:
    deadline = time.monotonic() + 30
    with daemon.client() as c:
        while time.monotonic() < deadline:
            model = next(m for m in c.status()["models"] if m["key"] == key)
            if model["running"] + model["queued"] >= count and model["running"] >= 1:
                return
            time.sleep(0.05)
    raise AssertionError(f"{key} never had {count} requests in flight")


def test_sigterm_drains_in_flight_work_and_cuts_the_rest(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\nshutdown_timeout_s = 2\n"
                         + model_entry("counter", loader="counting_generator",
                                       capability="text_to_text", max_workers=1, step_s=0.02))
    short: list[object] = []
    endless: list[object] = []
    threads = [_stream_in_thread(daemon, 40, short)]  # ~0.8 s of tokens
    _wait_running(daemon, "counter", 1)
    threads.append(_stream_in_thread(daemon, 1_000_000, endless))  # queued behind it
    _wait_running(daemon, "counter", 2)
    daemon.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(30)
    assert daemon.process.wait(20) == 0
    assert isinstance(short[-1], TextChunk) and short[-1].finish_reason == "length"
    assert isinstance(endless[-1], PoolError)
    assert endless[-1].code is ErrorCode.SHUTTING_DOWN
    assert "1 request(s) drained, 1 cut" in daemon.log()
    assert not os.path.exists(daemon.socket_path)


def test_killed_worker_request_is_retried_and_served(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n"
                         + model_entry("slow", run_s=1.5, max_workers=1))
    result: list[object] = []

    def run() -> None:
        with daemon.client() as c:
            result.append(c.embed("abcd", model="slow"))

    thread = threading.Thread(target=run)
    thread.start()
    _wait_running(daemon, "slow", 1)
    with daemon.client() as c:
        model = next(m for m in c.status()["models"] if m["key"] == "slow")
    (worker,) = model["workers"]
    os.kill(worker["pid"], signal.SIGKILL)
    thread.join(30)
    assert result and result[0][0] == 4.0  # len("abcd"): the retried request's real answer
    assert "killed by SIGKILL" in daemon.log()


def test_poison_input_fails_with_worker_died_and_others_are_served(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n"
                         + model_entry("slow", run_s=0, max_workers=1))
    with daemon.client() as c:
        with pytest.raises(PoolError) as err:
            c.embed("CRASH", model="slow")
        assert err.value.code is ErrorCode.WORKER_DIED
        assert "already retried" in err.value.message
        assert c.embed("fine", model="slow")[0] == 4.0


def test_modules_in_the_working_directory_are_never_imported(tmp_path: Path) -> None:
    """A stray queue.py where the daemon was started once broke every worker start (and
    would have run its code in each)."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    marker = tmp_path / "imported"
    (workdir / "queue.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                      "raise SystemExit('the stray queue.py was imported')\n")
    config = tmp_path / "modelpool.toml"
    config.write_text("[pool]\ncold_start_workers = 1\n" + model_entry("fast"))
    socket_path = fresh_socket_path()
    modelpool = str(Path(sys.executable).with_name("modelpool"))
    log = (tmp_path / "daemon.log").open("wb")
    process = subprocess.Popen([modelpool, "--socket", socket_path, "serve", "--config",
                                str(config)], cwd=workdir, env=daemon_env(socket_path),
                               stdout=log, stderr=subprocess.STDOUT)
    daemon = Daemon(process, socket_path, tmp_path / "daemon.log")
    try:
        wait_for_socket(daemon, 30)
        with daemon.client() as c:
            assert c.embed("abc", model="fast")[0] == 3.0
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert not marker.exists()
