"""Socket activation (sd_listen_fds(3)) with no library: when systemd (a `.socket` unit)
or any other launcher passes the listening socket, it sets LISTEN_PID to the daemon's
pid and LISTEN_FDS to how many sockets it passed, from fd 3 on. The daemon then serves
that socket instead of binding its own, and leaves its path alone at exit: the socket
unit owns it, and keeps it listening (and queues clients) while the daemon restarts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

LISTEN_FDS_START = 3
ENV_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class ActivationError(Exception):
    """What was passed cannot be served (several sockets, not a listening Unix stream)."""


def take_listening_socket(environ: MutableMapping[str, str] | None = None,
                          pid: int | None = None) -> socket.socket | None:
    """The socket passed to this process, or None if none was. The variables are taken
    out of the environment either way, so no child of the daemon takes them for its own."""
    env = os.environ if environ is None else environ
    listen_pid, listen_fds, _ = (env.pop(name, None) for name in ENV_VARS)
    if not listen_pid or not listen_fds:
        return None
    if listen_pid.strip() != str(os.getpid() if pid is None else pid):
        return None  # meant for another process (we inherited it from our parent)
    try:
        count = int(listen_fds)
    except ValueError:
        raise ActivationError(f"LISTEN_FDS={listen_fds!r} is not a number") from None
    if count == 0:
        return None
    if count != 1:
        raise ActivationError(f"{count} sockets were passed (LISTEN_FDS); modelpool serves "
                              f"one: give its .socket unit a single ListenStream=")
    return _check(LISTEN_FDS_START)


def _check(fd: int) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"fd {fd} (LISTEN_FDS) is not a socket: {exc.strerror}") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        sock.detach()  # not ours to close
        raise ActivationError(f"fd {fd} (LISTEN_FDS) is not a listening Unix stream socket "
                              f"(ListenStream= with a path)")
    sock.set_inheritable(False)  # passed without close-on-exec: workers must not hold it
    sock.setblocking(False)
    return sock


def socket_name(sock: socket.socket) -> str:
    """Its path, or "@name" for an abstract one (as systemd writes them)."""
    name = sock.getsockname()
    if isinstance(name, bytes):
        return "@" + name[1:].decode(errors="replace") if name else "(unnamed)"
    return name or "(unnamed)"
