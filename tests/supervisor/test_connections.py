"""The front door without sockets: the caps on clients' unread replies, idle and frame
timeouts, places for clients, decoding that never raises, quiet accept errors."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embed, Error
from modelpool.protocol.peers import Peer
from modelpool.protocol.wire import server_decoder
from modelpool.supervisor.acceptor import Acceptor, auto_max_connections
from modelpool.supervisor.access import AccessPolicy
from modelpool.supervisor.config import DaemonConfig
from modelpool.supervisor.connections import Connection, ConnectionTable
from modelpool.supervisor.frontdoor import decode_request

KB = 1024


class FakeScheduler:
    """Time that moves only when told (no timers needed here)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeTransport:
    """Holds whatever is written (unless the client reads at once) until the test says
    the client read it."""

    def __init__(self, reads: bool) -> None:
        self.reads = reads
        self.buffer = 0
        self.aborted = False
        self.closing = False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self.buffer

    def is_closing(self) -> bool:
        return self.closing or self.aborted

    def abort(self) -> None:
        self.aborted = True


class FakeWriter:
    def __init__(self, reads: bool) -> None:
        self.transport = FakeTransport(reads)
        self.frames: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.frames.append(data)
        if not self.transport.reads:
            self.transport.buffer += len(data)

    def close(self) -> None:
        self.transport.closing = True

    def messages(self) -> list[Any]:
        return [server_decoder.decode(f[4:]) for f in self.frames]


ME = Peer(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid(), groups=())
POLICY = AccessPolicy(daemon_uid=os.geteuid())


def table(scheduler: FakeScheduler, **daemon: Any) -> ConnectionTable:
    config = DaemonConfig(**{"max_client_buffer_bytes": 64 * KB,
                             "max_unread_total_bytes": 100 * KB, **daemon})
    return ConnectionTable(config, max_connections=3, now=scheduler.now)


def connect(t: ConnectionTable, greeted: bool = True,
            reads: bool = False) -> tuple[Connection, FakeWriter]:
    writer = FakeWriter(reads)
    assert t.reserve()
    conn = Connection(None, writer, t, POLICY, ME)  # type: ignore[arg-type]
    t.admit(conn)
    if greeted:
        conn.frame_started = None
    return conn, writer


def reply_of(size: int) -> Error:
    return Error(id=1, code=ErrorCode.MODEL_ERROR, message="x" * size)


def test_a_client_over_its_own_cap_is_dropped() -> None:
    t = table(FakeScheduler())
    hog, hog_writer = connect(t)
    other, _ = connect(t)
    hog.send(reply_of(40 * KB))
    assert not hog.closed
    hog.send(reply_of(40 * KB))
    assert hog.closed and hog_writer.transport.aborted and not other.closed
    assert t.unsent_total == 0


def test_over_the_total_the_client_holding_most_is_dropped() -> None:
    t = table(FakeScheduler())
    (a, _), (b, _), (c, _) = connect(t), connect(t), connect(t)
    a.send(reply_of(30 * KB))
    b.send(reply_of(50 * KB))
    assert not b.closed
    c.send(reply_of(30 * KB))  # 110 KiB in all: b holds the most, though c went over
    assert b.closed and not a.closed and not c.closed
    assert t.unsent_total <= 100 * KB


def test_replies_a_client_has_read_are_not_held_against_anyone() -> None:
    t = table(FakeScheduler())
    (a, a_writer), (b, _) = connect(t), connect(t)
    a.send(reply_of(60 * KB))
    a_writer.transport.buffer = 0  # the client read them; the table has not looked since
    b.send(reply_of(60 * KB))
    assert not a.closed and not b.closed
    assert t.unsent_total == b.unsent()


def test_places_are_reserved_at_accept_and_given_back() -> None:
    t = table(FakeScheduler())
    assert t.reserve() and t.reserve() and t.reserve()
    assert not t.reserve()
    t.release()
    conn, _ = connect(t)
    assert not t.reserve()
    conn.close()
    assert t.reserve()


def test_an_idle_client_is_told_and_closed_but_not_one_with_work() -> None:
    clock = FakeScheduler()
    t = table(clock, idle_timeout_s=10.0)
    (idle, idle_writer), (busy, busy_writer) = connect(t, reads=True), connect(t, reads=True)
    busy.jobs[5] = object()
    clock.advance(9)
    t.sweep()
    assert not idle.closed
    clock.advance(2)
    t.sweep()
    assert idle.closed and idle_writer.transport.closing and not idle_writer.transport.aborted
    assert [(m.code, m.id) for m in idle_writer.messages()] == [(ErrorCode.UNAVAILABLE, None)]
    assert not busy.closed and busy_writer.frames == []


def test_idle_timeout_zero_never_closes() -> None:
    clock = FakeScheduler()
    t = table(clock, idle_timeout_s=0.0)
    conn, _ = connect(t)
    clock.advance(1e6)
    t.sweep()
    assert not conn.closed


def test_a_frame_or_a_hello_too_slow_to_arrive_is_cut_off() -> None:
    clock = FakeScheduler()
    t = table(clock, frame_timeout_s=5.0)
    no_hello, _ = connect(t, greeted=False)
    midway, midway_writer = connect(t)
    midway.frame_started = clock.now()
    busy, _ = connect(t)
    busy.jobs[1] = object()
    busy.frame_started = clock.now()
    clock.advance(6)
    t.sweep()
    assert no_hello.closed and midway.closed and busy.closed  # work in flight or not
    assert "frame_timeout_s" in midway_writer.messages()[0].message


def test_a_goodbye_to_a_client_that_does_not_read_closes_at_once() -> None:
    t = table(FakeScheduler())
    conn, writer = connect(t)
    conn.send(reply_of(10 * KB))
    conn.goodbye(ErrorCode.UNAVAILABLE, "bye")
    assert writer.transport.aborted  # a graceful close would wait for it to read


# ---- decoding -------------------------------------------------------------------------

enc = msgspec.msgpack.encode


def test_invalid_utf8_is_a_bad_request_naming_the_id() -> None:
    payload = (b"\x83" + enc("op") + enc("embed") + enc("id") + enc(7)
               + enc("texts") + b"\x91\xa1\xff")
    err = decode_request(payload)
    assert isinstance(err, Error) and err.id == 7 and err.code is ErrorCode.BAD_REQUEST
    assert "UTF-8" in err.message


def test_deep_nesting_is_a_bad_request() -> None:
    payload = b"\x82" + enc("id") + enc(3) + enc("junk") + b"\x91" * 200_000 + b"\xc0"
    err = decode_request(payload)
    assert isinstance(err, Error) and err.code is ErrorCode.BAD_REQUEST
    assert "nested too deeply" in err.message


def test_the_id_is_found_past_a_bomb_without_building_it() -> None:
    count = 1 << 20
    payload = (b"\x83" + enc("op") + enc("embed") + enc("junk") + b"\xdd"
               + count.to_bytes(4, "big") + b"\x90" * count + enc("id") + enc(11))
    err = decode_request(payload)
    assert isinstance(err, Error) and err.id == 11


def test_a_good_request_decodes() -> None:
    msg = Embed(id=1, texts=["a"])
    assert decode_request(enc(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_no_bytes_make_decoding_raise(payload: bytes) -> None:
    decode_request(payload)


# ---- accepting ------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "allowed"), [(256, 128), (512, 384), (1024, 768),
                                                (100, 1), (1 << 20, 4096)])
def test_connections_allowed_by_an_fd_limit(limit: int, allowed: int) -> None:
    assert auto_max_connections(limit) == allowed


def test_accept_failures_are_logged_once_per_period(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeScheduler()
    acceptor = Acceptor(None, clock, lambda sock: True, lambda: b"")  # type: ignore[arg-type]
    failure = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.WARNING, logger="modelpool.server"):
        for _ in range(1000):
            acceptor._note_failure(failure)
            clock.advance(0.01)
        clock.advance(0.1)
        acceptor._note_failure(failure)
    assert len(caplog.records) == 2
    assert "more since" in caplog.records[1].getMessage()
