"""Who may reach the daemon and what they may do, against real daemons: a socket
directory planted by another user, a daemon (or impostor) of an untrusted user, clients
of another user, management commands and priority caps.

The other user is `postgres` (uid 101, gid 104), in a subprocess: the tests run as root.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from adversarial_helpers import (
    OTHER_GID,
    OTHER_UID,
    ROOT,
    Daemon,
    MakeDaemon,
    as_other_user,
    daemon_env,
    fresh_socket_path,
    model_entry,
    other_user_env,
    wait_for_socket,
)

from modelpool.protocol.client import AsyncClient, Client
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.peers import DAEMON_UID_ENV
from modelpool.supervisor import cgroups

SLOW = model_entry("slow", run_s=0, max_workers=1)
GROUP_SOCKET = '[daemon]\nsocket_group = "postgres"\n'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

# A client of another user: connects, runs ops on one connection, prints what happened.
CLIENT = """
import json, sys
from modelpool.protocol.client import Client, PoolError
path, ops, connections = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
report = {"connect": [], "results": []}
for _ in range(connections):
    try:
        client = Client(socket_path=path, timeout_s=30)
    except PoolError as exc:
        report["connect"].append([exc.code.value, exc.message])
        continue
    report["connect"].append(None)
    with client:
        for op in ops:
            name, _, arg = op.partition(":")
            try:
                if name == "embed":
                    client.embed("x", model="slow", priority=arg)
                    result = ""
                elif name in ("stop", "status"):
                    result = getattr(client, name)()
                else:
                    result = getattr(client, name)(arg)
                report["results"].append(["ok", str(result)[:200]])
            except PoolError as exc:
                report["results"].append([exc.code.value, exc.message])
print(json.dumps(report))
"""


def other_user_client(socket_path: str, ops: list[str], connections: int = 1) -> dict[str, Any]:
    run = subprocess.run(as_other_user([sys.executable, "-c", CLIENT, socket_path,
                                        json.dumps(ops), str(connections)]),
                         cwd=ROOT, capture_output=True, timeout=60, env=other_user_env())
    assert run.returncode == 0, run.stderr.decode(errors="replace")
    return json.loads(run.stdout)


def access_log_lines(daemon: Daemon) -> list[str]:
    return [line for line in daemon.log().splitlines() if "modelpool.access" in line]


# ---- the socket's directory ------------------------------------------------------------


def test_a_socket_directory_planted_by_another_user_is_refused() -> None:
    """The issue's attack: with XDG_RUNTIME_DIR unset the default socket directory is
    /tmp/modelpool-$USER, which another user can make first."""
    user = f"mpt-victim-{os.getpid()}"
    planted = Path(f"/tmp/modelpool-{user}")
    planted.mkdir(mode=0o777)
    try:
        os.chown(planted, OTHER_UID, OTHER_GID)
        env = {k: v for k, v in daemon_env("").items()
               if k not in ("MODELPOOL_SOCKET", "XDG_RUNTIME_DIR")}
        env.update(LOGNAME=user, USER=user)
        process = subprocess.Popen([sys.executable, "-m", "modelpool.supervisor.cli", "serve"],
                                   cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail(f"the daemon served from {planted}, a directory of uid {OTHER_UID}")
        assert process.returncode == 1, stderr
        assert str(planted).encode() in stderr and b"uid 101 (postgres)" in stderr
        assert list(planted.iterdir()) == []  # nothing left behind: no socket ...
        serving = cgroups.own_cpu_cgroup_dir()  # ... and no loading cgroup
        if serving is not None:
            assert not cgroups.loading_cgroup_dir(serving, process.pid).exists()
    finally:
        for leftover in planted.iterdir():
            leftover.unlink()
        planted.rmdir()


# ---- clients check the daemon ----------------------------------------------------------


@pytest.fixture
def other_users_daemon() -> Iterator[Daemon]:
    """A daemon running as postgres, as a system daemon with a user of its own would."""
    home = Path(tempfile.mkdtemp(prefix="mpt-home-", dir="/tmp"))
    os.chown(home, OTHER_UID, OTHER_GID)
    config = home / "modelpool.toml"
    config.write_text(SLOW)
    socket_path = fresh_socket_path()
    log_path = Path(tempfile.mkdtemp(prefix="mpt-log-")) / "daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(as_other_user(
            [sys.executable, "-m", "modelpool.supervisor.cli", "--socket", socket_path,
             "serve", "--config", str(config)]),
            cwd=ROOT, env={**daemon_env(socket_path), "HOME": str(home)}, stdout=log,
            stderr=subprocess.STDOUT)
    daemon = Daemon(process, socket_path, log_path)
    try:
        wait_for_socket(daemon, 30)
        yield daemon
    finally:
        try:
            daemon.stop()
        finally:
            for child in daemon.descendants():
                child.kill()
            subprocess.run(["rm", "-rf", str(home), str(log_path.parent),
                            os.path.dirname(socket_path)], check=False)


def test_a_client_refuses_a_daemon_of_another_user_unless_told_to_trust_it(
        other_users_daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    path = other_users_daemon.socket_path
    monkeypatch.delenv(DAEMON_UID_ENV, raising=False)
    with pytest.raises(PoolError) as refused:
        Client(socket_path=path, timeout_s=30)
    assert refused.value.code is ErrorCode.UNAVAILABLE
    assert "uid 101 (postgres)" in refused.value.message
    with Client(socket_path=path, timeout_s=30, daemon_uid="postgres") as c:
        assert c.daemon.uid == OTHER_UID
        assert c.embed("trusted", model="slow").shape == (8,)
    monkeypatch.setenv(DAEMON_UID_ENV, str(OTHER_UID))
    with Client(socket_path=path, timeout_s=30) as c:
        assert c.status()["pid"] == other_users_daemon.process.pid


def test_an_async_client_refuses_it_too(other_users_daemon: Daemon,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DAEMON_UID_ENV, raising=False)

    async def run() -> Any:
        with pytest.raises(PoolError, match="uid 101"):
            await AsyncClient(other_users_daemon.socket_path).connect()
        async with AsyncClient(other_users_daemon.socket_path, daemon_uid=OTHER_UID) as c:
            return await c.embed("trusted", model="slow")

    assert asyncio.run(asyncio.wait_for(run(), 30)).shape == (8,)


IMPOSTOR = """
import socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("listening", flush=True)
conn, _ = listener.accept()
conn.settimeout(10)
received = 0
try:
    while chunk := conn.recv(65536):
        received += len(chunk)
except OSError:
    pass
print(received, flush=True)
"""


def test_an_impostor_on_the_socket_receives_nothing() -> None:
    """Whoever listens on the socket as another user gets not one byte of a request."""
    directory = Path(tempfile.mkdtemp(prefix="mpt-imp-", dir="/tmp"))
    directory.chmod(0o777)
    path = str(directory / "mp.sock")
    impostor = subprocess.Popen(as_other_user([sys.executable, "-c", IMPOSTOR, path]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert impostor.stdout is not None and impostor.stdout.readline() == "listening\n"
        with pytest.raises(PoolError, match="uid 101"):
            Client(socket_path=path, timeout_s=5).embed("a secret")
        out, _ = impostor.communicate(timeout=15)
        assert out.strip() == "0"
    finally:
        if impostor.poll() is None:
            impostor.send_signal(signal.SIGKILL)
            impostor.wait()
        subprocess.run(["rm", "-rf", str(directory)], check=False)


# ---- the daemon checks its clients -----------------------------------------------------


def test_a_client_of_another_user_is_refused_by_default(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(GROUP_SOCKET + SLOW)  # the group can reach the socket ...
    report = other_user_client(daemon.socket_path, ["status"], connections=3)
    assert report["results"] == []  # ... but may not use it
    for code, message in report["connect"]:
        assert code == "PERMISSION_DENIED" and "uid 101 (postgres)" in message
    refusals = access_log_lines(daemon)
    assert len(refusals) == 3 and all("refused a connection" in line for line in refusals)
    assert any("allow_groups" in line for line in daemon.log().splitlines())  # warned at start
    with daemon.client() as c:  # its own user still may
        assert c.embed("mine", model="slow", priority="critical").shape == (8,)


def test_management_is_refused_and_priorities_capped_for_an_allowed_group(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(GROUP_SOCKET + SLOW + """
        [access]
        allow_groups = ["postgres"]
        max_priority = "normal"
    """)
    ops = ["embed:normal", "embed:critical", "embed:high", "embed:low",
           "stop", "load:slow", "unload:slow", "stop", "status"]
    report = other_user_client(daemon.socket_path, ops)
    assert report["connect"] == [None]
    codes = [code for code, _ in report["results"]]
    assert codes == ["ok", "BAD_REQUEST", "BAD_REQUEST", "ok", "PERMISSION_DENIED",
                     "PERMISSION_DENIED", "PERMISSION_DENIED", "PERMISSION_DENIED", "ok"]
    assert "'normal'" in report["results"][1][1]  # names the allowed priority
    assert "uid 101 (postgres)" in report["results"][4][1]
    assert len(access_log_lines(daemon)) == 1  # once per connection, not per frame
    assert daemon.process.poll() is None
    with daemon.client() as c:  # the daemon's own user: uncapped, may manage
        assert c.embed("mine", model="slow", priority="critical").shape == (8,)
        assert "keeping 1 worker" in c.load("slow")
        c.unload("slow")


def test_admin_users_may_manage_and_per_user_caps_apply(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(GROUP_SOCKET + SLOW + """
        [access]
        allow_users = ["postgres"]
        admin_users = ["postgres"]
        max_priority_for = { postgres = "low" }
    """)
    report = other_user_client(daemon.socket_path,
                               ["embed:low", "embed:normal", "load:slow", "unload:slow", "stop"])
    assert [code for code, _ in report["results"]] == ["ok", "BAD_REQUEST", "ok", "ok", "ok"]
    assert "'low'" in report["results"][1][1]
    assert daemon.process.wait(30) == 0  # stopped by the admin
    assert not os.path.exists(daemon.socket_path)


def test_the_socket_directory_lets_only_the_group_in(make_daemon: MakeDaemon) -> None:
    """The group may search the directory (to reach the socket), not list or change it."""
    daemon = make_daemon(GROUP_SOCKET + SLOW)
    directory = os.stat(os.path.dirname(daemon.socket_path))
    assert (directory.st_mode & 0o777, directory.st_gid) == (0o710, OTHER_GID)
    sock = os.stat(daemon.socket_path)
    assert (sock.st_mode & 0o777, sock.st_gid) == (0o660, OTHER_GID)
