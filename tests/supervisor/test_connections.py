"""Client connections without sockets: the caps on clients' unread replies, idle and
frame timeouts, places for clients, frames read whole and in order."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import HEADER, LARGE_FRAME_BYTES, frame
from modelpool.protocol.messages import Error
from modelpool.protocol.peers import Peer
from modelpool.protocol.wire import server_decoder
from modelpool.supervisor.acceptor import auto_max_connections
from modelpool.supervisor.access import AccessPolicy
from modelpool.supervisor.config import DaemonConfig
from modelpool.supervisor.connections import Connection, ConnectionTable

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
        self.reading = True
        self.frames: list[bytes] = []

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return self.buffer

    def is_closing(self) -> bool:
        return self.closing or self.aborted

    def write(self, data: bytes) -> None:
        self.frames.append(data)
        if not self.reads:
            self.buffer += len(data)

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def messages(self) -> list[Any]:
        return [server_decoder.decode(f[4:]) for f in self.frames]


class FakeHandler:
    """Records what a connection hands on; greets every hello but b"bad"."""

    def __init__(self) -> None:
        self.hellos: list[bytes] = []
        self.frames: list[bytes] = []
        self.gone: list[Connection] = []

    def greet(self, conn: Connection, payload: bytes | bytearray) -> bool:
        self.hellos.append(bytes(payload))
        return payload != b"bad"

    def handle_frame(self, conn: Connection, payload: bytes | bytearray) -> None:
        self.frames.append(bytes(payload))

    def reading(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def gone(self, conn: Connection) -> None:  # type: ignore[override]
        self.gone.append(conn)


ME = Peer(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid(), groups=())
POLICY = AccessPolicy(daemon_uid=os.geteuid())


def table(scheduler: FakeScheduler, **daemon: Any) -> ConnectionTable:
    config = DaemonConfig(**{"max_client_buffer_bytes": 64 * KB,
                             "max_unread_total_bytes": 100 * KB, "max_connections": 3,
                             **daemon})
    return ConnectionTable(config, fd_limit=1024, now=scheduler.now)


def connect(t: ConnectionTable, greeted: bool = True, reads: bool = False,
            handler: FakeHandler | None = None, limit: int = 64 * KB,
            policy: AccessPolicy = POLICY,
            defer: Any = None) -> tuple[Connection, FakeTransport]:
    transport = FakeTransport(reads)
    assert t.reserve()
    conn = Connection(t, policy, ME, handler or FakeHandler(), limit, defer=defer)
    conn.connection_made(transport)  # type: ignore[arg-type]
    if greeted:
        conn.greeted, conn.frame_started = True, None
    return conn, transport


def reply_of(size: int) -> Error:
    return Error(id=1, code=ErrorCode.MODEL_ERROR, message="x" * size)


def test_a_client_over_its_own_cap_is_dropped() -> None:
    t = table(FakeScheduler())
    hog, hog_writer = connect(t)
    other, _ = connect(t)
    hog.send(reply_of(40 * KB))
    assert not hog.closed
    hog.send(reply_of(40 * KB))
    assert hog.closed and hog_writer.aborted and not other.closed
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


def test_a_dropped_clients_replies_not_yet_written_are_let_go_at_once() -> None:
    """As the daemon runs: a turn's replies wait to be written together at its end."""
    t = table(FakeScheduler())
    turn_end: list[Any] = []
    (hog, hog_writer), (other, _) = (connect(t, defer=turn_end.append),
                                     connect(t, defer=turn_end.append))
    for _ in range(3):  # the hog goes over its own cap at its second
        hog.send(reply_of(40 * KB))
        other.send(reply_of(10 * KB))
    assert hog.closed and not other.closed
    assert hog.pending == [] and hog.pending_bytes == 0  # not held until hog is freed
    for flush in turn_end:
        flush()
    assert hog_writer.frames == [] and t.unsent_total == other.unsent() == 3 * other_frame()


def other_frame() -> int:
    return len(frame(msgspec.msgpack.encode(reply_of(10 * KB))))


def test_replies_a_client_has_read_are_not_held_against_anyone() -> None:
    t = table(FakeScheduler())
    (a, a_writer), (b, _) = connect(t), connect(t)
    a.send(reply_of(60 * KB))
    a_writer.buffer = 0  # the client read them; the table has not looked since
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
    assert idle.closed and idle_writer.closing and not idle_writer.aborted
    assert [(m.code, m.id) for m in idle_writer.messages()] == [(ErrorCode.UNAVAILABLE, None)]
    assert not busy.closed and busy_writer.frames == []


def test_reloaded_limits_apply_to_open_connections() -> None:
    clock = FakeScheduler()
    t = table(clock, idle_timeout_s=10.0)
    (idle, idle_writer), (hog, hog_writer) = connect(t, reads=True), connect(t)
    t.follow_config(DaemonConfig(idle_timeout_s=2.0, max_client_buffer_bytes=2 * KB))
    hog.send(reply_of(3 * KB))
    assert hog.closed and hog_writer.aborted
    clock.advance(3)
    t.sweep()
    assert idle.closed and "idle for 2 s" in idle_writer.messages()[0].message


def test_a_reloaded_connection_cap_admits_or_holds_back_the_next_clients() -> None:
    t = table(FakeScheduler())  # max_connections = 3
    conns = [connect(t)[0] for _ in range(3)]
    assert not t.reserve()
    t.follow_config(DaemonConfig(max_connections=4))
    assert t.reserve() and not t.reserve()
    t.release()
    t.follow_config(DaemonConfig(max_connections=1))  # under what is open: none closed
    assert not t.reserve() and not any(c.closed for c in conns)
    t.follow_config(DaemonConfig(max_connections=0))  # from the fd limit again
    assert t.max_connections == auto_max_connections(1024) and t.reserve()


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
    assert writer.aborted  # a graceful close would wait for it to read


# ---- decoding -------------------------------------------------------------------------

enc = msgspec.msgpack.encode


@given(payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=6),
       cuts=st.lists(st.integers(min_value=0, max_value=1500), max_size=10))
@settings(max_examples=60)
def test_frames_cut_anywhere_reach_the_handler_whole_and_in_order(
        payloads: list[bytes], cuts: list[int]) -> None:
    handler = FakeHandler()
    conn, _ = connect(table(FakeScheduler()), greeted=False, handler=handler)
    stream = frame(b"hello") + b"".join(frame(p) for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    for a, b in itertools.pairwise(bounds):
        conn.data_received(stream[a:b])
    assert handler.hellos == [b"hello"] and handler.frames == payloads
    assert conn.frame_started is None


def test_an_oversized_frame_is_answered_skipped_as_it_comes_and_the_next_served() -> None:
    sched = FakeScheduler()
    handler = FakeHandler()
    conn, transport = connect(table(sched), handler=handler, limit=100)
    conn.data_received(HEADER.pack(150) + b"x" * 50)
    assert "exceeds the limit" in transport.messages()[0].message
    assert conn.frame_started == sched.now()  # the frame timeout bounds the skipping
    conn.data_received(b"x" * 100 + frame(b"next"))
    assert handler.frames == [b"next"] and conn.frame_started is None


def test_a_large_frame_grows_in_its_own_buffer_and_is_handed_on_as_it_is() -> None:
    handler = FakeHandler()
    conn, _ = connect(table(FakeScheduler()), handler=handler, limit=4 * LARGE_FRAME_BYTES)
    body = bytes(range(256)) * (LARGE_FRAME_BYTES // 128)  # 2 MiB
    data = frame(body) + frame(b"after")
    for i in range(0, len(data), 300_000):
        conn.data_received(data[i:i + 300_000])
    assert handler.frames == [body, b"after"]
    assert conn.frames.buffer == b""


def test_while_replies_back_up_no_request_is_read_then_all_are() -> None:
    handler = FakeHandler()
    conn, transport = connect(table(FakeScheduler()), handler=handler)
    conn.pause_writing()
    conn.data_received(frame(b"a") + frame(b"b"))
    assert handler.frames == [] and not transport.reading
    assert conn.frame_started is None  # waiting on us is no slow frame
    conn.resume_writing()
    assert handler.frames == [b"a", b"b"] and transport.reading


def test_the_stream_ending_mid_frame_is_answered_then_closed() -> None:
    conn, transport = connect(table(FakeScheduler()))
    conn.data_received(HEADER.pack(10) + b"abc")
    assert conn.eof_received() is False
    assert transport.messages()[0].message == \
        "truncated frame: the stream ended after 3 of 10 bytes"
    assert conn.closed and transport.closing


def test_a_bad_hello_closes_and_nothing_after_it_is_read() -> None:
    handler = FakeHandler()
    conn, transport = connect(table(FakeScheduler()), greeted=False, handler=handler)
    conn.data_received(frame(b"bad") + frame(b"request"))
    assert handler.hellos == [b"bad"] and handler.frames == []
    assert conn.closed and transport.closing


def test_a_refused_client_gets_the_refusal_and_is_closed_at_its_hello() -> None:
    async def run() -> tuple[Connection, FakeTransport, FakeHandler]:
        handler = FakeHandler()
        strangers_only = AccessPolicy(daemon_uid=os.geteuid() + 12345)
        nobody = Peer(pid=1, uid=os.geteuid() + 1, gid=1, groups=())
        t = table(FakeScheduler())
        assert t.reserve()
        conn = Connection(t, strangers_only, nobody, handler, 64 * KB)
        transport = FakeTransport(reads=True)
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.data_received(frame(b"hello"))
        return conn, transport, handler

    conn, transport, handler = asyncio.run(run())
    assert transport.messages()[0].code is ErrorCode.PERMISSION_DENIED
    assert conn.closed and transport.closing and handler.hellos == []
