"""`modelpool reload` and SIGHUP on a real daemon: models added, removed and changed
while requests run, and a bad config that changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from conftest import ROOT, Daemon, MakeDaemon, daemon_env, model_entry, wait_until, worker_pids

from modelpool.protocol.client import Client
from modelpool.protocol.errors import ErrorCode, PoolError


def rewrite(daemon: Daemon, config_toml: str) -> None:
    (daemon.log_path.parent / "modelpool.toml").write_text(textwrap.dedent(config_toml))


def one_at_a_time(key: str, run_s: float) -> str:
    return model_entry(key, max_workers=1, run_s=run_s).replace(
        "max_workers = 1", "max_workers = 1\n        max_batch = 1")


def model_state(c: Client, key: str) -> str | None:
    return next((m["state"] for m in c.status()["models"] if m["key"] == key), None)


def model_counts(c: Client, key: str) -> tuple[int, int] | None:
    """(running, queued)"""
    model = next((m for m in c.status()["models"] if m["key"] == key), None)
    return (model["running"], model["queued"]) if model else None


def test_reload_adds_removes_and_replaces_models_without_losing_work(
        make_daemon: MakeDaemon) -> None:
    before = (model_entry("keep") + one_at_a_time("gone", run_s=1.5)
              + model_entry("changed", max_workers=1, mark=1))
    daemon = make_daemon(before)
    with daemon.client() as c:
        assert c.embed(["x"], model="changed")[0][-1] == 1.0
        (old,) = worker_pids(c, "changed")
        results: list[Any] = []

        def slow(text: str) -> None:
            with daemon.client() as other:
                results.append(other.embed([text], model="gone"))

        threads = [threading.Thread(target=slow, args=(t,)) for t in ("running", "queued")]
        for thread in threads:
            thread.start()
        wait_until(lambda: model_counts(c, "gone") == (1, 1), 30,
                   "one request of gone runs and one waits")
        rewrite(daemon, model_entry("keep", max_workers=1)
                + model_entry("changed", max_workers=1, mark=2) + model_entry("added", mark=3))
        message = c.reload()
        assert message == ("added: added; removed (serving what it has, then stopping): "
                           "gone; replaced (its workers, one at a time): changed; "
                           "updated: keep")
        with pytest.raises(PoolError) as refused:
            c.embed(["late"], model="gone")
        assert refused.value.code is ErrorCode.UNKNOWN_MODEL
        assert c.embed(["new"], model="added")[0][-1] == 3.0
        assert "gone" not in [m["key"] for m in c.models()]
        for thread in threads:
            thread.join(30)
        assert [len(r) for r in results] == [1, 1]  # both answered, by the removed model
        wait_until(lambda: model_state(c, "gone") is None, 30, "gone has left the status")
        # The changed model's worker is replaced; until then the old one serves.
        wait_until(lambda: c.embed(["y"], model="changed")[0][-1] == 2.0, 30,
                   "changed runs its new options")
        wait_until(lambda: old not in worker_pids(c, "changed"), 30, "its old worker stopped")
    assert "config reloaded: added: added" in daemon.log()


def test_a_bad_config_changes_nothing_and_sighup_reloads(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(model_entry("a"))
    with daemon.client() as c:
        rewrite(daemon, "[[models]]\nkey = 'b'\ncapability = 'no_such_thing'\n")
        with pytest.raises(PoolError) as bad:
            c.reload()
        assert bad.value.code is ErrorCode.BAD_REQUEST
        assert "no_such_thing" in bad.value.message
        assert "goes on with the config it has" in bad.value.message
        assert len(c.embed(["still"], model="a")) == 1

        rewrite(daemon, model_entry("a") + model_entry("b") + "\n[cluster]\nnode_name = 'n2'\n")
        daemon.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "b" in [m["key"] for m in c.models()], 30, "b is known")
        assert len(c.embed(["new"], model="b")) == 1
    assert "changes of [cluster] apply at the next start" in daemon.log()


def test_a_reloaded_pool_applies_at_once_and_renews_workers_started_otherwise(
        make_daemon: MakeDaemon) -> None:
    """[pool] and [jobs] without a restart: the loaded model keeps serving, lowered
    timeouts bound the next request and the next job, and new threads per worker
    replace its worker."""
    models = model_entry("slow", max_workers=1, run_s=1.5)
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n" + models)
    with daemon.client() as c:
        assert len(c.embed(["warm"], model="slow")) == 1
        (old,) = worker_pids(c, "slow")
        threads = len(os.sched_getaffinity(0)) + 1  # not the cores, as it started with
        rewrite(daemon, "[pool]\ncold_start_workers = 1\ntimeout_s = 0.5\n"
                f"threads_per_worker = {threads}\n[jobs]\ntimeout_s = 0.5\n" + models)
        assert c.reload() == "[pool], [jobs] applied"
        started = time.monotonic()
        with pytest.raises(PoolError) as late:
            c.embed(["x"], model="slow")
        assert late.value.code is ErrorCode.TIMEOUT and time.monotonic() - started < 1.4
        with pytest.raises(PoolError) as late_job:  # [jobs]'s timeout (3600 s before)
            c.retrieve(c.submit("embed", ["j"], model="slow"), timeout_s=30)
        assert late_job.value.code is ErrorCode.TIMEOUT
        wait_until(lambda: old not in worker_pids(c, "slow"), 30, "its worker is replaced")
        (new,) = wait_until(lambda: worker_pids(c, "slow"), 30, "a new worker serves")
        assert len(c.embed(["y"], model="slow", timeout_s=30)) == 1
        assert worker_pids(c, "slow") == [new]
    assert "the threads, batch or heartbeat its workers started with changed" in daemon.log()


def test_the_reload_command(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(model_entry("a"))
    rewrite(daemon, model_entry("a") + model_entry("b"))
    done = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "reload"],
                          cwd=ROOT, env=daemon_env(daemon.socket_path), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "added: b"
    rewrite(daemon, "[pool]\nno_such_knob = 1\n")
    bad = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "reload"],
                         cwd=ROOT, env=daemon_env(daemon.socket_path), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 5
    assert "no_such_knob" in bad.stderr and "goes on with the config it has" in bad.stderr


def test_jobs_waiting_for_a_removed_model_end_saying_so(make_daemon: MakeDaemon) -> None:
    """Those already in the model's queue are served; those still in the job queue,
    which nothing here would run any more, end at once with UNKNOWN_MODEL."""
    daemon = make_daemon(one_at_a_time("j", run_s=0.3) + model_entry("other"))
    with daemon.client() as c:
        keys = [c.submit("embed", [f"t{i}"], model="j") for i in range(14)]
        wait_until(lambda: (model_counts(c, "j") or (0, 0))[0] == 1, 30, "j runs")
        rewrite(daemon, model_entry("other"))
        assert c.reload().startswith("removed")
        served, ended = 0, []
        for key in keys:
            try:
                c.retrieve(key, timeout_s=30)
                served += 1
            except PoolError as exc:
                ended.append(exc)
    assert served >= 1 and len(ended) >= 1 and served + len(ended) == 14
    for exc in ended:
        assert exc.code is ErrorCode.UNKNOWN_MODEL
        assert "removed from the daemon's config (reload)" in exc.message


def test_a_reloaded_daemon_section_applies_its_client_limits_and_log_level(
        make_daemon: MakeDaemon) -> None:
    """An open connection is closed at the new idle timeout; at log_level WARNING the
    daemon's info lines stop (the reload's own among them)."""
    daemon = make_daemon(model_entry("a"))
    with daemon.client() as idle, daemon.client() as c:
        assert len(idle.embed(["x"], model="a")) == 1
        rewrite(daemon, model_entry("a") + "\n[daemon]\nidle_timeout_s = 1\n")
        assert c.reload() == "[daemon] applied"
        time.sleep(2.5)  # idle past the timeout, and a sweep (every 0.25 s now) after it
        with pytest.raises(PoolError) as closed:
            idle.embed(["y"], model="a")
        assert "idle_timeout_s" in closed.value.message
        rewrite(daemon, model_entry("a")
                + "\n[daemon]\nidle_timeout_s = 1\nlog_level = \"WARNING\"\n")
        with daemon.client() as again:
            assert again.reload() == "[daemon] applied"
    assert daemon.log().count("config reloaded: [daemon] applied") == 1


def test_a_reloaded_frame_cap_and_connection_cap_apply_to_the_next_clients(
        make_daemon: MakeDaemon) -> None:
    """A connection keeps the frame cap it was told when it connected; the next ones are
    told the new one. A connection cap under what is open closes none."""
    daemon = make_daemon(model_entry("a"))
    text = "word " * 2000  # a frame of ~10 KB
    with daemon.client() as before:
        rewrite(daemon, model_entry("a")
                + "\n[daemon]\nmax_frame_bytes = 4096\nmax_connections = 2\n")
        assert before.reload() == "[daemon] applied"
        assert len(before.embed([text], model="a")) == 1
        with daemon.client() as after:
            with pytest.raises(PoolError) as too_large:
                after.embed([text], model="a")
            assert "limit of 4096" in too_large.value.message
            assert len(after.embed(["x"], model="a")) == 1
            with pytest.raises(PoolError) as full, daemon.client() as third:
                third.embed(["x"], model="a")
            assert full.value.code is ErrorCode.OVERLOADED
            assert "max_connections" in full.value.message
        assert len(before.embed([text], model="a")) == 1


def fifo_permitted() -> bool:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    except PermissionError:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    return True


@pytest.mark.skipif(not fifo_permitted(), reason="SCHED_FIFO needs root, CAP_SYS_NICE or an "
                    "RLIMIT_RTPRIO of at least 1")
def test_realtime_is_set_and_unset_by_a_reload(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(model_entry("a"))

    def policy() -> int:
        return os.sched_getscheduler(daemon.process.pid) & ~os.SCHED_RESET_ON_FORK

    assert policy() == os.SCHED_OTHER
    with daemon.client() as c:
        rewrite(daemon, model_entry("a") + "\n[daemon]\nrealtime = true\n")
        assert c.reload() == "[daemon] applied"
        assert policy() == os.SCHED_FIFO
        assert len(c.embed(["x"], model="a")) == 1
        rewrite(daemon, model_entry("a"))
        assert c.reload() == "[daemon] applied"
        assert policy() == os.SCHED_OTHER
    assert "event loop runs at normal priority" in daemon.log()
