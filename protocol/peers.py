"""Who is at the other end of a Unix socket (SO_PEERCRED), and which daemons a client
trusts. Shared by the daemon (checking its clients) and the client (checking the daemon).

The kernel records the credentials of each end when it connects or listens, so neither
end can lie about them; a client checks the daemon's before it sends anything.
"""

from __future__ import annotations

import array
import errno
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError

DAEMON_UID_ENV = "MODELPOOL_DAEMON_UID"  # a user (name or uid) whose daemon clients trust
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; not named by Python
_MAX_GROUPS = 65536  # NGROUPS_MAX


@dataclass(frozen=True)
class Peer:
    """The process at the other end: its pid, effective uid and gid, and every group it
    was in when it connected (gid first)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_of(sock: Any) -> Peer:
    """The peer of a connected (or accepted) Unix socket: a socket.socket or asyncio's
    TransportSocket."""
    pid, uid, gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Peer(pid=pid, uid=uid, gid=gid, groups=(gid, *_peer_groups(sock, gid)))


def _peer_groups(sock: Any, gid: int) -> tuple[int, ...]:
    """The peer's supplementary groups; () where the kernel cannot say."""
    for count in (64, _MAX_GROUPS):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * count)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue  # more groups than the buffer holds
            return ()
        groups = array.array("I", raw)
        return tuple(g for g in groups if g != gid)
    return ()


def user_name(uid: int) -> str:
    """'uid 101 (postgres)', or 'uid 4242' for a uid without a name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def uid_of(user: int | str) -> int:
    """A uid given as a number, a string of digits or a user name. KeyError if unknown."""
    if isinstance(user, int):
        return user
    return int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid


def trusted_daemon_uids(daemon_uid: int | str | None = None) -> frozenset[int]:
    """Whose daemon a client talks to: its own uid, root, and daemon_uid (else
    $MODELPOOL_DAEMON_UID) for a system daemon that runs as a user of its own."""
    trusted = {os.geteuid(), 0}
    other = daemon_uid if daemon_uid is not None else os.environ.get(DAEMON_UID_ENV) or None
    if other is not None:
        try:
            trusted.add(uid_of(other))
        except KeyError:
            raise PoolError(ErrorCode.UNAVAILABLE,
                            f"no user {other!r} (the daemon's user, from "
                            f"{'daemon_uid' if daemon_uid is not None else DAEMON_UID_ENV})"
                            ) from None
    return frozenset(trusted)


def check_daemon(sock: Any, socket_path: str, trusted: frozenset[int]) -> Peer:
    """The daemon's credentials, if its uid is trusted; else PoolError(UNAVAILABLE) naming
    the uid. Called right after connecting, before anything is sent: whoever answers on
    the socket of another user would otherwise read every request."""
    peer = peer_of(sock)
    if peer.uid not in trusted:
        raise PoolError(
            ErrorCode.UNAVAILABLE,
            f"refusing the daemon on {socket_path}: it runs as {user_name(peer.uid)} (pid "
            f"{peer.pid}), which is neither you nor root; if that is the daemon you mean, "
            f"trust it with {DAEMON_UID_ENV}={peer.uid} or daemon_uid={peer.uid}")
    return peer
