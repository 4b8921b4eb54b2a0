"""[access] changed by a reload, against a real daemon and a client of another user
(`postgres`, in a subprocess: the tests run as root) that keeps its connection open
across the reloads: a new cap applies to its next request, and a user the config no
longer admits is told why and closed, and cannot connect again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from adversarial_helpers import ROOT, Daemon, MakeDaemon, as_other_user, model_entry, other_user_env

SLOW = model_entry("slow", run_s=0, max_workers=1)
GROUP_SOCKET = '[daemon]\nsocket_group = "postgres"\n'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")

# One connection kept open; each line on stdin is an op, each answered by a line: "ok"
# or the error's code. "connect" opens (and closes) a second connection.
KEPT_CLIENT = """
import sys
from modelpool.protocol.client import Client, PoolError
path = sys.argv[1]
kept = Client(socket_path=path, timeout_s=30)
print("ready", flush=True)
for line in sys.stdin:
    op, _, priority = line.strip().partition(":")
    try:
        if op == "embed":
            kept.embed("x", model="slow", priority=priority)
        else:
            Client(socket_path=path, timeout_s=30).close()
        print("ok", flush=True)
    except PoolError as exc:
        print(exc.code.value, exc.message.replace("\\n", " "), flush=True)
"""


def reload_to(daemon: Daemon, config_toml: str) -> str:
    (daemon.log_path.parent / "modelpool.toml").write_text(textwrap.dedent(config_toml))
    with daemon.client() as c:
        return c.reload()


def test_a_reloaded_access_applies_to_open_connections(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(GROUP_SOCKET + SLOW + '\n[access]\nallow_users = ["postgres"]\n')
    client = subprocess.Popen(as_other_user([sys.executable, "-c", KEPT_CLIENT,
                                             daemon.socket_path]),
                              cwd=ROOT, env=other_user_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert client.stdin is not None and client.stdout is not None

    def ask(op: str) -> str:
        assert client.stdin is not None and client.stdout is not None
        client.stdin.write(op + "\n")
        client.stdin.flush()
        return client.stdout.readline().strip()

    try:
        assert client.stdout.readline().strip() == "ready", client.stderr
        assert ask("embed:high") == "ok"

        capped = '\n[access]\nallow_users = ["postgres"]\nmax_priority = "normal"\n'
        assert reload_to(daemon, GROUP_SOCKET + SLOW + capped) == "[access] applied"
        high = ask("embed:high")
        assert high.startswith("BAD_REQUEST") and "'normal'" in high  # the same connection
        assert ask("embed:normal") == "ok"
        assert ask("connect") == "ok"

        assert reload_to(daemon, GROUP_SOCKET + SLOW) == "[access] applied"
        closed = ask("embed:normal")
        assert closed.startswith("PERMISSION_DENIED"), closed
        assert "config was reloaded" in closed and "uid 101 (postgres)" in closed
        assert ask("connect").startswith("PERMISSION_DENIED")
    finally:
        client.kill()
        client.communicate()
    with daemon.client() as c:  # the daemon's own user is never refused
        assert c.embed("mine", model="slow", priority="critical").shape == (8,)
    assert reload_to(daemon, GROUP_SOCKET + SLOW) == "no change"
    assert daemon.process.poll() is None


def test_a_group_admitted_by_a_reload_may_connect(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(GROUP_SOCKET + SLOW)
    before = subprocess.run(as_other_user([sys.executable, "-c", KEPT_CLIENT,
                                           daemon.socket_path]),
                            cwd=ROOT, env=other_user_env(), capture_output=True, text=True,
                            timeout=60)
    assert "PERMISSION_DENIED" in before.stderr  # refused at the hello, before the reload
    admitted = '\n[access]\nallow_groups = ["postgres"]\n'
    assert reload_to(daemon, GROUP_SOCKET + SLOW + admitted) == "[access] applied"
    run = subprocess.run(as_other_user([sys.executable, "-c", KEPT_CLIENT,
                                        daemon.socket_path]),
                         cwd=ROOT, env=other_user_env(), input="embed:normal\n",
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.split("\n")[:2] == ["ready", "ok"], run.stderr
    assert "config reloaded: [access] applied" in daemon.log()


def other_user_embeds(daemon: Daemon) -> subprocess.CompletedProcess[str]:
    return subprocess.run(as_other_user([sys.executable, "-c", KEPT_CLIENT,
                                         daemon.socket_path]),
                          cwd=ROOT, env=other_user_env(), input="embed:normal\n",
                          capture_output=True, text=True, timeout=60)


def test_a_socket_group_set_by_a_reload_lets_the_group_reach_the_socket(
        make_daemon: MakeDaemon) -> None:
    admitted = SLOW + '\n[access]\nallow_groups = ["postgres"]\n'
    daemon = make_daemon(admitted)
    assert "Permission denied" in other_user_embeds(daemon).stderr  # the directory is 0700

    assert reload_to(daemon, GROUP_SOCKET + admitted) == "[daemon] applied"
    run = other_user_embeds(daemon)
    assert run.stdout.split("\n")[:2] == ["ready", "ok"], run.stderr

    assert reload_to(daemon, admitted) == "[daemon] applied"
    assert "Permission denied" in other_user_embeds(daemon).stderr
    with daemon.client() as c:
        assert c.embed("mine", model="slow").shape == (8,)
    assert "socket_group" not in daemon.log()  # nothing to warn about
