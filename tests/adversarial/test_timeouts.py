"""Connections that linger: idle ones are closed (never one with work in flight), a frame
that trickles in is cut off, and a request id reused while in flight is refused without
a second final reply for that id."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from adversarial_helpers import (
    closed_within,
    greeted,
    model_entry,
    raw_connection,
    reply,
    running_daemon,
    send_msg,
)

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import HEADER
from modelpool.protocol.messages import Embed, Embeddings, Error, GetStatus, StatusReply

CONFIG = """
[daemon]
idle_timeout_s = 1
frame_timeout_s = 1
""" + model_entry("slow", run_s=2.5, max_workers=1)


def test_idle_connections_are_closed_but_never_one_with_work_in_flight(tmp_path: Path) -> None:
    with running_daemon(tmp_path, CONFIG) as daemon:
        with daemon.client() as c:
            c.embed("warm", model="slow")
        idle = greeted(daemon.socket_path)
        busy = greeted(daemon.socket_path)
        send_msg(busy, Embed(id=1, model="slow", texts=["takes 2.5 s"]))
        got, seconds = closed_within(idle, 5)
        assert seconds is not None and seconds < 2.5, seconds
        assert [(m.code, m.id) for m in got] == [(ErrorCode.UNAVAILABLE, None)]
        answer = reply(busy)  # its request outlives the idle timeout: still answered
        assert isinstance(answer, Embeddings) and answer.id == 1
        _, seconds = closed_within(busy, 5)
        assert seconds is not None  # and then, idle, it goes too


def test_a_client_closed_while_idle_says_why_at_its_next_call(tmp_path: Path) -> None:
    """The blocking client finds the connection closed when it sends; it reports the
    daemon's last word, not the broken pipe."""
    with running_daemon(tmp_path, CONFIG) as daemon, daemon.client() as c:
        c.embed("warm", model="slow")
        time.sleep(2.5)  # idle_timeout_s is 1; the sweep runs every 0.25 s
        with pytest.raises(PoolError) as raised:
            c.embed("late", model="slow")
        assert raised.value.code is ErrorCode.UNAVAILABLE
        assert "idle_timeout_s" in raised.value.message, raised.value.message


def test_a_frame_that_trickles_in_is_cut_off(tmp_path: Path) -> None:
    with running_daemon(tmp_path, CONFIG) as daemon:
        no_hello = raw_connection(daemon.socket_path)
        slow = greeted(daemon.socket_path)
        slow.sendall(HEADER.pack(1000))
        start = time.monotonic()
        for _ in range(10):  # a byte every 0.3 s: never idle, never done
            try:
                slow.sendall(b"x")
            except OSError:
                break
            time.sleep(0.3)
        got, _ = closed_within(slow, 3)
        assert time.monotonic() - start < 3.5
        assert [m.code for m in got] == [ErrorCode.BAD_REQUEST]
        assert "frame_timeout_s" in got[0].message
        _, seconds = closed_within(no_hello, 3)
        assert seconds is not None  # the hello is a frame too


def test_a_reused_in_flight_id_is_refused_without_a_second_final_reply(
        tmp_path: Path) -> None:
    with running_daemon(tmp_path, CONFIG) as daemon:
        sock = greeted(daemon.socket_path, timeout_s=30)
        send_msg(sock, Embed(id=7, model="slow", texts=["first"]))
        send_msg(sock, Embed(id=7, model="slow", texts=["second, same id"]))
        send_msg(sock, GetStatus(id=7))  # a status reply for 7 would end request 7 too
        for _ in range(2):
            refused = reply(sock)
            assert isinstance(refused, Error) and refused.id is None, refused
            assert refused.code is ErrorCode.BAD_REQUEST and "7" in refused.message
        answer = reply(sock)
        assert isinstance(answer, Embeddings) and answer.id == 7
        assert struct.unpack_from("<f", answer.data)[0] == len("first")  # the first's answer
        send_msg(sock, GetStatus(id=8))
        after = reply(sock)  # nothing else came for 7
        assert isinstance(after, StatusReply) and after.id == 8
        send_msg(sock, GetStatus(id=7))  # once answered, the id is free again
        assert isinstance(reply(sock), StatusReply)
        sock.close()
