"""Where the daemon's socket lives by default (shared by the daemon and its clients)."""

from __future__ import annotations

import getpass
import os


def default_socket_path() -> str:
    """$MODELPOOL_SOCKET, else $XDG_RUNTIME_DIR/modelpool.sock, else a per-user dir in /tmp."""
    explicit = os.environ.get("MODELPOOL_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "modelpool.sock")
    return os.path.join("/tmp", f"modelpool-{getpass.getuser()}", "modelpool.sock")
