"""Bad frames against a real daemon: each gets one typed BAD_REQUEST at once, the
connection goes on serving, other clients see nothing, the supervisor's memory holds."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from adversarial_helpers import (
    ROOT,
    Daemon,
    greeted,
    model_entry,
    reply,
    rss_mb,
    running_daemon,
    send_msg,
    send_raw,
)

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import HEADER
from modelpool.protocol.messages import Embed, Embeddings, Error

MB = 2**20

_spec = importlib.util.spec_from_file_location("_modelpool_fuzz_frames",
                                               ROOT / "scripts" / "fuzz_frames.py")
assert _spec is not None and _spec.loader is not None
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(tmp_path, model_entry("fast", run_s=0, max_workers=1)) as daemon:
        yield daemon


def embed(rid: int, text: str = "ok") -> Embed:
    return Embed(id=rid, model="fast", texts=[text])


def assert_bad_request(msg: object, rid: int | None) -> None:
    assert isinstance(msg, Error), msg
    assert msg.code is ErrorCode.BAD_REQUEST and msg.id == rid, msg


def test_every_kind_of_bad_frame_is_answered_and_the_connection_serves_on(
        daemon: Daemon) -> None:
    """Invalid UTF-8 and deep nesting used to drop the connection with no reply."""
    with greeted(daemon.socket_path) as sock:
        send_msg(sock, embed(1))
        assert isinstance(reply(sock), Embeddings)  # the worker is up: timings are the door's
        slowest = 0.0
        for n, (payload, rid) in enumerate(fuzz.fuzzed_frames(600, seed=14)):
            send_raw(sock, payload)
            start = time.monotonic()
            assert_bad_request(reply(sock), rid)
            slowest = max(slowest, time.monotonic() - start)
            if n % 100 == 0:
                send_msg(sock, embed(2 + n))
                answer = reply(sock)
                assert isinstance(answer, Embeddings) and answer.id == 2 + n
        assert slowest < 0.5, slowest  # 10 ms at p99 in scripts/adversarial.py; CI is noisy


def test_an_oversized_header_is_answered_before_its_bytes_arrive(daemon: Daemon) -> None:
    with greeted(daemon.socket_path) as sock:
        size = 64 * MB + 1
        sock.sendall(HEADER.pack(size))
        sock.settimeout(2)  # the bytes never come until the reply has: no deadlock here
        err = reply(sock)
        assert isinstance(err, Error) and "exceeds the limit" in err.message
        sock.settimeout(30)
        chunk = b"\0" * MB
        for _ in range(size // MB):
            sock.sendall(chunk)
        sock.sendall(b"\0" * (size % MB))
        send_msg(sock, embed(7))
        answer = reply(sock)
        assert isinstance(answer, Embeddings) and answer.id == 7


def test_a_bomb_of_empty_arrays_costs_little_memory_and_time(daemon: Daemon) -> None:
    """16 MiB of empty arrays: decoded untyped to find the id, it took ~1.2 GB and ~5 s."""
    frame = fuzz.bomb_frame(16 * MB, rid=9)
    others = OtherClient(daemon)
    with greeted(daemon.socket_path) as sock:
        send_msg(sock, embed(1))
        reply(sock)
        before = rss_mb(daemon.process.pid)
        send_raw(sock, frame)
        start = time.monotonic()
        assert_bad_request(reply(sock), 9)
        elapsed = time.monotonic() - start
        growth = rss_mb(daemon.process.pid) - before
        send_msg(sock, embed(10))
        assert isinstance(reply(sock), Embeddings)
    assert elapsed < 1.0, elapsed
    assert growth < 2 * len(frame) / MB, growth
    assert others.finish() == []


class OtherClient:
    """Another client embedding in a loop meanwhile; what went wrong for it, if anything."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.daemon.client(timeout_s=10) as c:
                while not self.stop.is_set():
                    c.embed("other", model="fast")
        except Exception as exc:
            self.errors.append(repr(exc))

    def finish(self) -> list[str]:
        self.stop.set()
        self.thread.join(20)
        return self.errors


def test_fuzzing_leaves_other_clients_alone_and_memory_flat(daemon: Daemon) -> None:
    others = OtherClient(daemon)
    with greeted(daemon.socket_path) as sock:
        for payload, _ in fuzz.fuzzed_frames(300, seed=1):
            send_raw(sock, payload)
            reply(sock)
        before = rss_mb(daemon.process.pid)
        for payload, rid in fuzz.fuzzed_frames(1500, seed=2):
            send_raw(sock, payload)
            assert_bad_request(reply(sock), rid)
        growth = rss_mb(daemon.process.pid) - before
    assert others.finish() == []
    assert growth < 20, growth
