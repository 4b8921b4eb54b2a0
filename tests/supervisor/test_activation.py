"""Socket activation: which passed sockets are taken, and what is refused. (The daemon
serving a passed fd 3 is tests/integration/test_systemd.py.)"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from modelpool.supervisor import activation
from modelpool.supervisor.activation import ActivationError


def test_nothing_passed_means_bind_our_own() -> None:
    assert activation.take_listening_socket({}, pid=42) is None
    assert activation.take_listening_socket({"LISTEN_PID": "42", "LISTEN_FDS": "0"},
                                            pid=42) is None


def test_sockets_passed_to_another_process_are_not_ours() -> None:
    env = {"LISTEN_PID": "41", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "modelpool.socket",
           "HOME": "/"}
    assert activation.take_listening_socket(env, pid=42) is None
    assert env == {"HOME": "/"}  # taken out anyway: no child of the daemon takes them


def test_several_sockets_are_refused_by_name() -> None:
    with pytest.raises(ActivationError, match="2 sockets"):
        activation.take_listening_socket({"LISTEN_PID": "42", "LISTEN_FDS": "2"}, pid=42)
    with pytest.raises(ActivationError, match="not a number"):
        activation.take_listening_socket({"LISTEN_PID": "42", "LISTEN_FDS": "x"}, pid=42)


def test_a_listening_unix_stream_socket_is_taken(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as original:
        original.bind(path)
        original.listen()
        fd = os.dup(original.fileno())
        os.set_inheritable(fd, True)  # as systemd passes it
        sock = activation._check(fd)
        try:
            assert not sock.get_inheritable()  # workers must not hold it
            assert not sock.getblocking()
            assert activation.socket_name(sock) == path
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(path)
                assert sock.accept()[0] is not None
        finally:
            sock.close()


@pytest.mark.parametrize("kind", ["unbound stream", "datagram", "tcp"])
def test_anything_else_is_refused_and_left_open(kind: str) -> None:
    family, type_ = {"unbound stream": (socket.AF_UNIX, socket.SOCK_STREAM),
                     "datagram": (socket.AF_UNIX, socket.SOCK_DGRAM),
                     "tcp": (socket.AF_INET, socket.SOCK_STREAM)}[kind]
    with socket.socket(family, type_) as other:
        if kind == "tcp":
            other.bind(("127.0.0.1", 0))
            other.listen()
        with pytest.raises(ActivationError, match="not a listening Unix stream socket"):
            activation._check(other.fileno())
        assert other.fileno() != -1 and other.getsockname() is not None


def test_a_file_is_not_a_socket(tmp_path: Path) -> None:
    with (tmp_path / "f").open("w") as f, pytest.raises(ActivationError, match="not a socket"):
        activation._check(f.fileno())


def test_abstract_names_are_written_as_systemd_does() -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(f"\0modelpool-test-{os.getpid()}")
        assert activation.socket_name(sock) == f"@modelpool-test-{os.getpid()}"
