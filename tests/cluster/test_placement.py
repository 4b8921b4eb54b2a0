"""Two daemons on one PostgreSQL where only one can run a model (its hub repo was pulled
on that host only): the other never claims that model's jobs, and jobs and direct
requests sent to it run on the node that can."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    Daemon,
    Database,
    model_status,
    node_config,
    nodes_seeing_each_other,
    start_node,
    wait_until,
)

from modelpool.protocol.errors import ErrorCode, PoolError

DIM = 8


# Model m, the hub repo org/m run by a test embedder. One text per pass, so that a
# queue builds up behind a busy worker.
MODEL = """
    [[models]]
    key = "m"
    capability = "text_embedding"
    loader = "mp_test_loaders:slow_embedder"
    repo = "org/m"
    options = { run_s = 0.1, mark = 1 }
    max_workers = 1
    max_batch = 1
"""


def hub_cache(path: Path, pulled: bool) -> dict[str, str]:
    """A node's environment naming its own hub cache, with org/m in it if `pulled`."""
    if pulled and not path.exists():
        repo = path / "models--org--m"
        commit = "0123456789abcdef0123456789abcdef01234567"
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    path.mkdir(parents=True, exist_ok=True)
    return {"HF_HUB_CACHE": str(path)}


def start(tmp_path: Path, database: Database, name: str, pulled: bool,
          cluster_extra: str = "") -> Daemon:
    return start_node(tmp_path / name, node_config(database.dsn, name, MODEL,
                                                   cluster_extra=cluster_extra),
                      env=hub_cache(tmp_path / f"{name}-hub", pulled))


@pytest.fixture
def beta_extra() -> str:
    """beta's [cluster] line, if any (a test overrides this fixture)."""
    return ""


@pytest.fixture
def two_nodes(tmp_path: Path, database: Database,
              beta_extra: str) -> Iterator[tuple[Daemon, Daemon]]:
    """alpha has m's files, beta has not."""
    with nodes_seeing_each_other(
            lambda: start(tmp_path, database, "alpha", pulled=True),
            lambda: start(tmp_path, database, "beta", pulled=False,
                          cluster_extra=beta_extra)) as (alpha, beta):
        yield alpha, beta


def expected(text: str) -> list[float]:
    return [float(len(text)), *map(float, range(1, DIM - 1)), 1.0]


def test_a_node_without_the_models_files_claims_none_of_its_jobs(
        two_nodes: tuple[Daemon, Daemon], database: Database) -> None:
    alpha, _ = two_nodes
    with alpha.client() as c:
        c.embed("warm", model="m")
        # A backlog on alpha, its one worker busy: beta sees no room there for seconds.
        keys = [c.submit("embed", f"job {i}", model="m") for i in range(30)]
        results = [c.retrieve(key, timeout_s=60) for key in keys]
    assert [np.asarray(r).tolist() for r in results] == [
        expected(f"job {i}") for i in range(30)]
    assert database.query("SELECT DISTINCT node, state FROM modelpool.jobs") == [
        ("alpha", "done")]


def test_a_node_without_the_models_files_passes_its_work_to_one_that_has_them(
        two_nodes: tuple[Daemon, Daemon], database: Database) -> None:
    _, beta = two_nodes
    with beta.client() as c:
        key = c.submit("embed", "a job", model="m")
        assert np.asarray(c.retrieve(key, timeout_s=60)).tolist() == expected("a job")
        assert np.asarray(c.embed("direct", model="m")).tolist() == expected("direct")
        status = c.status()
    assert model_status(status, "m")["workers"] == []  # nothing loaded here
    nodes = {node["name"]: node for node in status["cluster"]["nodes"]}
    assert "m" in nodes["alpha"]["runnable"] and "m" not in nodes["beta"]["runnable"]
    assert database.query("SELECT DISTINCT node FROM modelpool.jobs") == [("alpha",)]
    shown = cli_status(beta)
    lines = {line.split()[0]: line for line in shown.splitlines() if line.startswith("  ")}
    assert lines["beta"].endswith("cannot run m, which others can")
    assert "cannot run" not in lines["alpha"]


def test_jobs_that_no_live_node_can_run_wait_for_one_and_status_says_so(
        tmp_path: Path, two_nodes: tuple[Daemon, Daemon], database: Database) -> None:
    alpha, beta = two_nodes
    with alpha.client() as c:
        c.embed("warm", model="m")
        backlog = [c.submit("embed", f"job {i}", model="m") for i in range(30)]
    with beta.client() as c:
        key = c.submit("embed", "from beta", model="m")  # alpha can run it
    assert alpha.stop() == 0, alpha.log()  # leaves the backlog's rest in the queue
    with beta.client() as c:
        wait_until(lambda: len(c.status()["cluster"]["nodes"]) == 1, 30, "alpha is gone")
        shown = cli_status(beta)
        assert re.search(r"no live node can run m: its jobs end in \d+s unless one comes",
                         shown), shown
        time.sleep(1.5)  # a beat and some claim rounds: beta takes none of them
        assert database.query("SELECT state FROM modelpool.jobs WHERE key = %s",
                              (key,)) == [("queued",)]
        back = start(tmp_path, database, "alpha", pulled=True)
        try:
            result = c.retrieve(key, timeout_s=60)
            assert np.asarray(result).tolist() == expected("from beta")
            assert [np.asarray(c.retrieve(k, timeout_s=60)).tolist() for k in backlog] == [
                expected(f"job {i}") for i in range(30)]
        finally:
            assert back.stop() == 0, back.log()
    assert database.query("SELECT DISTINCT node, state FROM modelpool.jobs") == [
        ("alpha", "done")]


@pytest.mark.parametrize("beta_extra", ["stranded_timeout_s = 2"])
def test_a_waiting_job_ends_at_its_deadline_or_when_no_node_could_run_it_for_long(
        two_nodes: tuple[Daemon, Daemon], database: Database) -> None:
    alpha, beta = two_nodes
    with alpha.client() as c:
        c.embed("warm", model="m")
        for i in range(30):  # 3 s of work: beta's jobs wait behind it
            c.submit("embed", f"job {i}", model="m")
    with beta.client() as c:
        late = c.submit("embed", "late", model="m", deadline_s=0.5)
        stranded = c.submit("embed", "stranded", model="m")
        with pytest.raises(PoolError) as expired:
            c.retrieve(late, timeout_s=30)
        assert expired.value.code is ErrorCode.DEADLINE_EXPIRED
        assert "while it waited in the job queue" in expired.value.message
        assert c.job(late)["started_at"] is None  # never claimed
        assert alpha.stop() == 0, alpha.log()
        started = time.monotonic()
        with pytest.raises(PoolError) as ended:
            c.retrieve(stranded, timeout_s=30)
        waited_s = time.monotonic() - started
    assert ended.value.code is ErrorCode.MODEL_LOAD_FAILED
    assert "no live node could run model 'm' for 2s" in ended.value.message
    assert waited_s < 20  # alpha's last beat goes stale within 3 s, then 2 s
    assert database.query("SELECT count(*) FROM modelpool.jobs WHERE state = 'queued'") == [
        (0,)]


def cli_status(daemon: Daemon) -> str:
    return subprocess.run(
        [sys.executable, "-m", "modelpool.supervisor.cli", "status", "--socket",
         daemon.socket_path], capture_output=True, text=True, timeout=60, check=True).stdout


def test_with_no_node_able_to_run_it_the_model_is_refused_naming_the_cause(
        tmp_path: Path, database: Database) -> None:
    beta = start(tmp_path, database, "beta", pulled=False)
    try:
        with beta.client() as c:
            wait_until(lambda: c.status()["cluster"]["reachable"], 20, "the node connects")
            time.sleep(1.5)  # a beat after the start: it knows of no peer
            for call in (lambda: c.submit("embed", "a job", model="m"),
                         lambda: c.embed("direct", model="m")):
                with pytest.raises(PoolError) as refused:
                    call()
                assert refused.value.code is ErrorCode.MODEL_LOAD_FAILED
                assert "modelpool pull m" in refused.value.message
    finally:
        assert beta.stop() == 0, beta.log()
