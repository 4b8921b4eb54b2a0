"""Length-prefixed frames over a real socket pair and over an asyncio StreamReader."""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelpool.protocol.framing import (
    HEADER,
    MAX_FRAME_BYTES,
    FrameReader,
    FrameTooLarge,
    frame,
    read_frame,
    recv_frame,
    send_frame,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_frame_is_big_endian_length_prefix() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00\x00\x00\x00"
    assert HEADER.size == 4


def test_send_and_recv_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    send_frame(a, b"hello")
    send_frame(a, b"")
    send_frame(a, b"world" * 100)
    assert recv_frame(b) == b"hello"
    assert recv_frame(b) == b""
    assert recv_frame(b) == b"world" * 100


def test_frame_split_over_tiny_writes_arrives_whole(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payload = bytes(range(256)) * 8
    data = frame(payload) + frame(b"next")

    def trickle() -> None:
        for i in range(0, len(data), 3):
            a.sendall(data[i:i + 3])

    writer = threading.Thread(target=trickle)
    writer.start()
    try:
        assert recv_frame(b) == payload
        assert recv_frame(b) == b"next"
    finally:
        writer.join(5)


def test_recv_frame_over_limit_raises(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", 1001))
    with pytest.raises(FrameTooLarge) as info:
        recv_frame(b, limit=1000)
    assert info.value.size == 1001 and info.value.limit == 1000
    assert "1001" in str(info.value)


def test_recv_frame_at_limit_is_accepted(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    send_frame(a, b"x" * 1000)
    assert recv_frame(b, limit=1000) == b"x" * 1000


def test_default_limit_refuses_huge_announcement(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(FrameTooLarge):
        recv_frame(b)


def test_peer_closing_mid_frame_raises_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", 10) + b"abc")
    a.close()
    with pytest.raises(EOFError, match="3 of 10"):
        recv_frame(b)


def test_peer_closing_mid_header_raises_eof(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"\x00\x00")
    a.close()
    with pytest.raises(EOFError):
        recv_frame(b)


# ---- asyncio -----------------------------------------------------------------------


def _read_fed(data: bytes, eof: bool, limit: int = MAX_FRAME_BYTES, count: int = 1) -> list[bytes]:
    """Feed data into a fresh StreamReader and read count frames from it."""

    async def run() -> list[bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return [await read_frame(reader, limit) for _ in range(count)]

    return asyncio.run(asyncio.wait_for(run(), timeout=5))


def test_read_frame_reads_consecutive_frames() -> None:
    frames = _read_fed(frame(b"one") + frame(b"") + frame(b"three"), eof=True, count=3)
    assert frames == [b"one", b"", b"three"]


def test_read_frame_fed_in_pieces() -> None:
    async def run() -> bytes:
        reader = asyncio.StreamReader()
        task = asyncio.ensure_future(read_frame(reader))
        for byte in frame(b"pieces"):
            reader.feed_data(bytes([byte]))
            await asyncio.sleep(0)
        return await asyncio.wait_for(task, timeout=5)

    assert asyncio.run(run()) == b"pieces"


def test_read_frame_truncated_payload_raises_incomplete_read() -> None:
    with pytest.raises(asyncio.IncompleteReadError) as info:
        _read_fed(struct.pack(">I", 10) + b"abc", eof=True)
    assert info.value.partial == b"abc" and info.value.expected == 10


def test_read_frame_truncated_header_raises_incomplete_read() -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        _read_fed(b"\x00", eof=True)


def test_read_frame_clean_eof_raises_incomplete_read() -> None:
    with pytest.raises(asyncio.IncompleteReadError) as info:
        _read_fed(b"", eof=True)
    assert info.value.partial == b""


def test_read_frame_over_limit_raises() -> None:
    # Refused from the header alone: the body need not (and must not) be awaited.
    with pytest.raises(FrameTooLarge) as info:
        _read_fed(struct.pack(">I", 65), eof=False, limit=64)
    assert info.value.size == 65 and info.value.limit == 64


@given(payloads=st.lists(st.binary(max_size=300), max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12))
def test_frame_reader_gives_each_frame_whole_however_the_bytes_are_cut(
        payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    frames = FrameReader(large_from=100)  # the longer ones grow in their own buffer
    got: list[bytes | bytearray | int] = []
    for a, b in itertools.pairwise(bounds):
        frames.feed(stream[a:b])
        while (one := frames.next(300)) is not None:
            got.append(one)
        frames.compact()
    assert got == payloads
    assert frames.buffer == b"" and not frames.begun()


def test_frame_reader_skips_an_oversized_frame_and_says_how_far_a_begun_one_got() -> None:
    frames = FrameReader()
    frames.feed(HEADER.pack(11) + b"0123")
    assert frames.next(10) == 11  # over the limit: its 11 bytes are skipped as they come
    assert frames.next(10) is None and frames.progress() == (4, 11)
    frames.feed(b"456789a" + frame(b"abc") + frame(b"hello")[:6])
    assert frames.next(10) == b"abc"
    assert frames.next(10) is None and frames.progress() == (2, 5)
    frames.compact()
    assert frames.buffer == frame(b"hello")[:6]
