"""Length-prefixed frames: a 4-byte big-endian unsigned length, then that many bytes.

The same framing is used on the client socket and on the worker pipes, so one
reader and one writer serve both.
"""

from __future__ import annotations

import asyncio
import socket
import struct

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024


class FrameTooLarge(Exception):
    """A peer announced a frame above the limit; the stream cannot be resynchronised."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame. Raises asyncio.IncompleteReadError at EOF, FrameTooLarge over limit."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > limit:
        raise FrameTooLarge(size, limit)
    return await reader.readexactly(size)


class FrameBuffer:
    """Frames out of a byte stream fed as it arrives, for readers that are called with
    whatever bytes came (an asyncio Protocol), not ones that await each frame."""

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self.limit = limit
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames data completes, in order; the rest is kept for the next feed.
        Raises FrameTooLarge when a frame announces more than the limit."""
        buffer = self.buffer
        buffer += data
        frames, start, end = [], 0, len(buffer)
        with memoryview(buffer) as view:
            while end - start >= HEADER.size:
                (size,) = HEADER.unpack_from(view, start)
                if size > self.limit:
                    raise FrameTooLarge(size, self.limit)
                stop = start + HEADER.size + size
                if stop > end:
                    break
                frames.append(bytes(view[start + HEADER.size:stop]))
                start = stop
        del buffer[:start]
        return frames


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """Blocking read of exactly size bytes. Raises EOFError if the peer closed first."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise EOFError(f"peer closed after {got} of {size} bytes")
        got += n
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> bytes:
    (size,) = HEADER.unpack(recv_exactly(sock, HEADER.size))
    if size > limit:
        raise FrameTooLarge(size, limit)
    return recv_exactly(sock, size)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(frame(payload))
