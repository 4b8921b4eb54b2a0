"""The directory of the daemon's socket: made by the daemon, or refused when anyone but
the daemon's user (and root) could replace the socket in it; and the socket bound there.

Whoever can write to the socket's directory, or to any directory above it without the
sticky bit, or owns any of them, can swap the socket for their own and read or forge
every client's traffic; so can the owner of a symlink on the way. A directory another
user made in /tmp beforehand (/tmp/modelpool-$USER, the default without
XDG_RUNTIME_DIR) is exactly that. The checks follow the path component by component,
symlinks included, as the kernel resolves it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat

from modelpool.protocol.peers import user_name
from modelpool.supervisor.config import gid_of

log = logging.getLogger("modelpool.server")

LEAF_MODE = 0o700  # only the daemon's user may reach the socket ...
GROUP_LEAF_MODE = 0o710  # ... and, with socket_group, that group may search (not list) it
SOCKET_MODE = 0o600  # the socket: only the daemon's user may connect ...
GROUP_SOCKET_MODE = 0o660  # ... and, with socket_group, that group
PARENT_MODE = 0o755  # a missing directory above it
MAX_SYMLINKS = 40  # as the kernel's MAXSYMLINKS


class UnsafeSocketDir(Exception):
    """The socket's directory could be taken over by another user, or cannot be made."""


def judge_directory(st: os.stat_result, path: str, uid: int, leaf: bool) -> str | None:
    """Why a directory on the socket's path (leaf: the socket's own directory) lets
    someone other than uid and root replace the socket; None if it does not."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    owners = (uid,) if leaf else (uid, 0)
    if st.st_uid not in owners:
        return (f"{path} belongs to {user_name(st.st_uid)}, not to the daemon's user "
                f"({user_name(uid)}){'' if leaf else ' or root'}: its owner could replace "
                f"the socket")
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and (leaf or not st.st_mode & stat.S_ISVTX):
        return (f"{path} is writable by {_who(st)} (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"they could replace the socket")
    return None


def judge_symlink(st: os.stat_result, path: str, uid: int) -> str | None:
    """A symlink cannot be changed, only replaced, which its directory's rules govern;
    but in a sticky directory (/tmp) its owner may replace it."""
    if st.st_uid in (uid, 0):
        return None
    return (f"{path} is a symlink owned by {user_name(st.st_uid)}: its owner could point "
            f"it elsewhere")


def group_warning(st: os.stat_result, path: str, gid: int | None) -> str | None:
    """Why members of the socket's group cannot reach the socket, if they cannot."""
    if gid is None:
        return None
    if st.st_mode & stat.S_IXOTH or (st.st_gid == gid and st.st_mode & stat.S_IXGRP):
        return None
    return (f"members of group {gid} cannot reach the socket: {path} is mode "
            f"{stat.S_IMODE(st.st_mode):04o}, group {st.st_gid} (it needs g+x for group {gid})")


def secure_socket_dir(directory: str, gid: int | None, uid: int | None = None) -> list[str]:
    """Make the socket's directory (0700, or 0710 and owned by the socket's group gid)
    and any missing parent (0755), and check that no one but uid (default: ours) and
    root can replace the socket. Returns warnings; raises UnsafeSocketDir, leaving
    nothing it made behind."""
    uid = os.geteuid() if uid is None else uid
    created: list[str] = []
    try:
        leaf_path, leaf = _walk(os.path.abspath(directory), gid, uid, created)
    except UnsafeSocketDir:
        for made in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(made)
        raise
    warning = group_warning(leaf, leaf_path, gid)
    return [warning] if warning else []


def _walk(path: str, gid: int | None, uid: int, created: list[str]
          ) -> tuple[str, os.stat_result]:
    """Resolve path one component at a time (making what is missing), judging each."""
    todo = [part for part in path.split("/") if part]
    here = "/"
    st = os.lstat(here)
    _refuse(judge_directory(st, here, uid, leaf=not todo))
    links = 0
    while todo:
        name = todo.pop(0)
        if name in (".", ".."):
            here = os.path.dirname(here) if name == ".." else here
            continue
        candidate = os.path.join(here, name)
        st = _lstat_or_make(candidate, leaf=not todo, gid=gid, created=created)
        if stat.S_ISLNK(st.st_mode):
            _refuse(judge_symlink(st, candidate, uid))
            links += 1
            if links > MAX_SYMLINKS:
                raise UnsafeSocketDir(f"too many symlinks resolving {path}")
            target = os.readlink(candidate)
            here = "/" if target.startswith("/") else here
            todo[:0] = [part for part in target.split("/") if part]
            continue
        _refuse(judge_directory(st, candidate, uid, leaf=not todo))
        here = candidate
    return here, st


def _lstat_or_make(path: str, leaf: bool, gid: int | None, created: list[str]
                   ) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(path, 0o700)  # closed from the first moment, opened below if need be
    except FileExistsError:
        return os.lstat(path)  # someone made it meanwhile: judged like any other
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot make the socket's directory {path}: {exc.strerror}"
                              ) from exc
    created.append(path)
    try:
        if leaf and gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, (GROUP_LEAF_MODE if gid is not None else LEAF_MODE) if leaf
                 else PARENT_MODE)
    except OSError as exc:
        raise UnsafeSocketDir(f"cannot set up the socket's directory {path}: {exc.strerror}"
                              ) from exc
    return os.lstat(path)


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise UnsafeSocketDir(f"refusing the socket's directory: {problem}")


def _who(st: os.stat_result) -> str:
    others = st.st_mode & stat.S_IWOTH
    group = st.st_mode & stat.S_IWGRP
    if others and group:
        return f"group {st.st_gid} and everyone"
    return "everyone" if others else f"group {st.st_gid}"


class AlreadyRunning(Exception):
    pass


def bind_unix_socket(path: str, group: str | None) -> socket.socket:
    """Bind with the right mode from the start (umask before bind, not chmod after), in
    a directory no one else can swap it in (socket_dir.py)."""
    gid = gid_of(group) if group else None
    for warning in secure_socket_dir(os.path.dirname(path) or ".", gid):
        log.warning("%s", warning)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise AlreadyRunning(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise AlreadyRunning(f"another daemon is serving {path}")
        except ConnectionRefusedError:
            os.unlink(path)  # stale: its daemon died without cleaning up
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~(GROUP_SOCKET_MODE if group else SOCKET_MODE))
    try:
        sock.bind(path)
    finally:
        os.umask(old_umask)
    if gid is not None:
        os.chown(path, -1, gid)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def regroup_socket(path: str, group: str | None, made_dir: bool) -> list[str]:
    """A reloaded socket_group for the socket bound at start: the socket's group and mode
    (0660 for a group, else 0600), and its directory's (0710 or 0700) when the daemon
    made it; a directory it found is left as it is, as at start. Everything is closed
    first and opened to the new group last, so no one outside both groups ever gets in.
    Open connections stay: [access] decides who may use the daemon. Returns warnings."""
    gid = gid_of(group) if group else None
    directory = os.path.dirname(os.path.abspath(path))
    try:
        if made_dir:
            os.chmod(directory, LEAF_MODE)
        os.chmod(path, SOCKET_MODE)
        owner_gid = os.getegid() if gid is None else gid
        for target in ([directory] if made_dir else []) + [path]:
            os.chown(target, -1, owner_gid)
        if gid is not None:
            os.chmod(path, GROUP_SOCKET_MODE)
            if made_dir:
                os.chmod(directory, GROUP_LEAF_MODE)
    except OSError as exc:
        return [f"socket_group {group!r} not applied ({exc}): only the daemon's user may "
                f"reach {path} now"]
    warning = group_warning(os.stat(directory), directory, gid)
    return [warning] if warning else []
