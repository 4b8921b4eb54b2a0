"""The client library against a scripted fake daemon, and its image input conversion."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from modelpool.protocol.client import AsyncClient, Client
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import MAX_FRAME_BYTES, recv_frame, send_frame
from modelpool.protocol.inputs import image_input
from modelpool.protocol.messages import Embeddings, Error, Welcome, encoder
from modelpool.protocol.wire import client_decoder

Script = Callable[[socket.socket], None]


@pytest.fixture
def fake_daemon() -> Iterator[Callable[[Script], str]]:
    """fake_daemon(script) -> socket path; script talks to the one client after Welcome."""
    path = f"/tmp/mp-fake-{os.getpid()}-{threading.get_ident()}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    threads: list[threading.Thread] = []

    def start(script: Script) -> str:
        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                client_decoder.decode(recv_frame(conn))  # the Hello
                send_frame(conn, encoder.encode(Welcome(protocol_version=1,
                                                        server_version="fake",
                                                        max_frame_bytes=1 << 20)))
                script(conn)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield start
    server.close()
    os.unlink(path)


def test_a_reply_this_client_cannot_read_is_a_protocol_error(
        fake_daemon: Callable[[Script], str]) -> None:
    def newer_daemon(conn: socket.socket) -> None:
        recv_frame(conn)  # the embed request
        send_frame(conn, msgspec.msgpack.encode({"op": "error", "id": 1,
                                                 "code": "SOME_FUTURE_CODE", "message": "?"}))

    with Client(socket_path=fake_daemon(newer_daemon)) as c, pytest.raises(PoolError) as err:
        c.embed("x")
    assert err.value.code is ErrorCode.PROTOCOL_VERSION


def test_requests_over_the_daemons_frame_limit_are_refused_locally(
        fake_daemon: Callable[[Script], str]) -> None:
    path = fake_daemon(lambda conn: None)
    with Client(socket_path=path) as c, pytest.raises(PoolError) as err:
        c.embed("x" * (2 << 20))  # the fake daemon's limit is 1 MiB
    assert err.value.code is ErrorCode.BAD_REQUEST and "limit" in err.value.message


def test_the_async_client_answers_waiters_and_later_calls_when_the_daemon_goes(
        fake_daemon: Callable[[Script], str]) -> None:
    """Requests in flight get UNAVAILABLE when the connection closes; a request after
    that is refused at once, not left waiting for a reply that cannot come."""
    def gone_after_two(conn: socket.socket) -> None:
        recv_frame(conn)
        recv_frame(conn)

    async def run() -> None:
        async with AsyncClient(fake_daemon(gone_after_two)) as c:
            waiting = await asyncio.gather(c.embed("a"), c.embed("b"),
                                           return_exceptions=True)
            assert all(isinstance(e, PoolError) and e.code is ErrorCode.UNAVAILABLE
                       for e in waiting), waiting
            with pytest.raises(PoolError) as later:
                await asyncio.wait_for(c.embed("c"), 5)
            assert later.value.code is ErrorCode.UNAVAILABLE

    asyncio.run(run())


def test_the_async_clients_requests_of_one_loop_turn_leave_in_one_write(
        fake_daemon: Callable[[Script], str]) -> None:
    """Ten tasks asking at once make one write, so the daemon reads all ten at once."""
    first_read: list[int] = []

    def answer_all(conn: socket.socket) -> None:
        data = conn.recv(1 << 16)
        ids = []
        while data:  # whole frames: a 4-byte length, then the request
            size = int.from_bytes(data[:4], "big")
            ids.append(client_decoder.decode(data[4:4 + size]).id)
            data = data[4 + size:]
        first_read.append(len(ids))
        while len(ids) < 10:
            ids.append(client_decoder.decode(recv_frame(conn)).id)
        for rid in ids:
            send_frame(conn, encoder.encode(Embeddings(id=rid, dtype="float32", shape=[1, 1],
                                                       data=b"\0\0\x80?", tokens=1)))

    async def run() -> None:
        async with AsyncClient(fake_daemon(answer_all)) as c:
            vectors = await asyncio.wait_for(
                asyncio.gather(*(c.embed(f"t{i}") for i in range(10))), 10)
            assert [v.tolist() for v in vectors] == [[1.0]] * 10

    asyncio.run(run())
    assert first_read == [10]


def test_the_async_client_says_why_the_daemon_closed_the_connection(
        fake_daemon: Callable[[Script], str]) -> None:
    """The daemon's last word before it closes (an idle timeout, a revoked user, ...)
    is what a waiting request is told; a reply frame over the client's limit ends the
    connection with that reason, not a reader that dies."""
    def last_word(conn: socket.socket) -> None:
        recv_frame(conn)
        send_frame(conn, encoder.encode(Error(id=None, code=ErrorCode.PERMISSION_DENIED,
                                              message="the config was reloaded")))

    def oversized(conn: socket.socket) -> None:
        recv_frame(conn)
        conn.sendall((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        conn.recv(1)  # until the client hangs up

    async def run(script: Script) -> PoolError:
        async with AsyncClient(fake_daemon(script)) as c:
            with pytest.raises(PoolError) as err:
                await asyncio.wait_for(c.embed("x"), 10)
            assert not c.connected
            with pytest.raises(PoolError) as later:  # told again, not "not connected"
                await c.embed("y")
            assert later.value.message == err.value.message
            return err.value

    said = asyncio.run(run(last_word))
    assert said.code is ErrorCode.PERMISSION_DENIED and said.message == "the config was reloaded"
    too_large = asyncio.run(run(oversized))
    assert too_large.code is ErrorCode.UNAVAILABLE and "exceeds the limit" in too_large.message


def test_an_absent_daemon_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(PoolError) as err:
        Client(socket_path=str(tmp_path / "nobody.sock"))
    assert err.value.code is ErrorCode.UNAVAILABLE


def test_image_inputs_become_the_same_bytes(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buffer, format="PNG")
    data = buffer.getvalue()
    path = tmp_path / "x.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    for form in (data, bytearray(data), path, str(path), b64, f"data:image/png;base64,{b64}"):
        assert image_input(form).data == data
    pil = image_input(Image.open(io.BytesIO(data)))
    assert pil.data is not None and Image.open(io.BytesIO(pil.data)).size == (4, 4)
    assert image_input("https://example.com/x.png").url == "https://example.com/x.png"
    with pytest.raises(PoolError) as err:
        image_input("not a file, not a url, not base64!")
    assert err.value.code is ErrorCode.BAD_REQUEST
