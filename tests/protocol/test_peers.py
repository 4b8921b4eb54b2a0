"""Peer credentials and which daemons a client trusts."""

from __future__ import annotations

import os
import socket

import pytest

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.peers import DAEMON_UID_ENV, check_daemon, peer_of, trusted_daemon_uids


def test_peer_of_a_socket_is_the_process_at_the_other_end() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_of(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert peer.groups[0] == os.getegid()
    assert set(os.getgroups()) <= set(peer.groups)


def test_a_client_trusts_itself_and_root_and_whom_it_is_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DAEMON_UID_ENV, raising=False)
    assert trusted_daemon_uids() == {os.geteuid(), 0}
    assert trusted_daemon_uids(4242) == {os.geteuid(), 0, 4242}
    assert trusted_daemon_uids("postgres") == {os.geteuid(), 0, 101}
    monkeypatch.setenv(DAEMON_UID_ENV, "4243")
    assert trusted_daemon_uids() == {os.geteuid(), 0, 4243}
    assert trusted_daemon_uids(4242) == {os.geteuid(), 0, 4242}  # the argument wins
    with pytest.raises(PoolError, match="no user 'no-such-user-here'"):
        trusted_daemon_uids("no-such-user-here")


def test_an_untrusted_daemon_is_refused_naming_its_uid() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert check_daemon(a, "/x.sock", frozenset({os.geteuid()})).uid == os.geteuid()
        with pytest.raises(PoolError) as refused:
            check_daemon(a, "/x.sock", frozenset({os.geteuid() + 1}))
    assert refused.value.code is ErrorCode.UNAVAILABLE
    message = refused.value.message
    assert f"uid {os.geteuid()}" in message and DAEMON_UID_ENV in message
