"""Length-prefixed frames: a 4-byte big-endian unsigned length, then that many bytes.

The same framing is used on the client socket and on the worker pipes, so one
reader and one writer serve both.
"""

from __future__ import annotations

import asyncio
import socket
import struct

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size
_unpack_header = HEADER.unpack_from
MAX_FRAME_BYTES = 64 * 1024 * 1024
LARGE_FRAME_BYTES = 1 << 20  # FrameReader grows frames over this in their own buffer


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


class FrameReader:
    """Frames out of a byte stream fed as it arrives, for readers that are called with
    whatever bytes came (an asyncio Protocol), not ones that await each frame. A frame
    over `large_from` bytes grows in its own buffer and is handed on as it is: copied out of a
    shared one, a 64 MiB frame would be held twice. next() gives a whole frame, the size
    of one over the limit (whose bytes are then skipped as they come, so the framing
    stays intact), or None until more bytes arrive; compact() after a run of next()."""

    def __init__(self, large_from: int = LARGE_FRAME_BYTES) -> None:
        self.large_from = large_from
        self.buffer = bytearray()
        self.pos = 0  # where the unread bytes start; compacted after each read
        self.skip = 0  # bytes of an oversized frame still to discard ...
        self.skip_size = 0  # ... of this many
        self.large: bytearray | None = None
        self.large_size = 0

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next(self, limit: int) -> bytes | bytearray | int | None:
        if self.skip and not self._skipped():
            return None
        if self.large is not None:
            return self._grow()
        buffer, pos = self.buffer, self.pos
        if len(buffer) - pos < HEADER_BYTES:
            return None
        (size,) = _unpack_header(buffer, pos)
        if size > limit:
            self.pos += HEADER_BYTES
            self.skip = self.skip_size = size
            return size
        if size > self.large_from:
            self.pos += HEADER_BYTES
            self.large, self.large_size = bytearray(), size
            return self._grow()
        end = pos + HEADER_BYTES + size
        if end > len(buffer):
            return None
        self.pos = end
        return bytes(buffer[pos + HEADER_BYTES:end])  # (a memoryview here cost more)

    def _skipped(self) -> bool:
        """Discard what has come of the oversized frame: is all of it gone?"""
        taken = min(self.skip, len(self.buffer) - self.pos)
        self.pos += taken
        self.skip -= taken
        return not self.skip

    def _grow(self) -> bytearray | None:
        assert self.large is not None
        taken = min(self.large_size - len(self.large), len(self.buffer) - self.pos)
        with memoryview(self.buffer) as view:
            self.large += view[self.pos:self.pos + taken]
        self.pos += taken
        if len(self.large) < self.large_size:
            return None
        payload, self.large = self.large, None
        return payload

    def compact(self) -> None:
        del self.buffer[:self.pos]
        self.pos = 0

    def begun(self) -> bool:
        """Part of a frame has come (or is being skipped)."""
        return bool(self.skip) or self.large is not None or len(self.buffer) > self.pos

    def progress(self) -> tuple[int, int]:
        """(bytes come, bytes due) of the part of a frame begun: its header, its body."""
        if self.skip:
            return self.skip_size - self.skip, self.skip_size
        if self.large is not None:
            return len(self.large), self.large_size
        unread = len(self.buffer) - self.pos
        if unread < HEADER_BYTES:
            return unread, HEADER_BYTES
        return unread - HEADER_BYTES, int(_unpack_header(self.buffer, self.pos)[0])


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
