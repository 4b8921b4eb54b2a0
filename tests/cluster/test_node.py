"""One daemon on a real PostgreSQL: jobs through the shared queue, the cluster in status
and stats, a server that is down at start or crashes mid-run."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    FORCED_MINILM,
    Database,
    model_entry,
    node_config,
    start_node,
    wait_until,
)

from modelpool.protocol.errors import ErrorCode, PoolError

DIM = 8


def models(mark: float, run_s: float = 0.01) -> str:
    return model_entry("m", run_s=run_s, mark=mark)


def expected(text: str, mark: float) -> list[float]:
    return [float(len(text)), *map(float, range(1, DIM - 1)), mark]


def test_a_node_runs_jobs_through_postgres_and_shows_the_cluster(
        tmp_path: Path, database: Database) -> None:
    daemon = start_node(tmp_path, node_config(database.dsn, "alpha", models(mark=1)))
    try:
        with daemon.client() as c:
            wait_until(lambda: c.status()["cluster"]["reachable"], 20, "the node connects")
            key = c.submit("embed", "hello", model="m")
            result = c.retrieve(key, timeout_s=20)
            status = c.status()["cluster"]
            stats = c.stats()
            info = c.job(key)
        assert np.asarray(result).tolist() == expected("hello", 1)
        assert database.query("SELECT node, state, attempt FROM modelpool.jobs "
                              "WHERE key = %s", (key,)) == [("alpha", "done", 1)]
        assert info["node"] == "alpha" and info["state"] == "done"
        assert status["node"] == "alpha" and [n["name"] for n in status["nodes"]] == ["alpha"]
        assert status["nodes"][0]["models"]["m"]["ready"] == 1
        assert stats["nodes"] == 1 and stats["completed"] >= 1
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_without_postgres_cluster_operations_fail_clearly_and_direct_requests_work(
        tmp_path: Path, database: Database) -> None:
    database.server.stop()
    try:
        daemon = start_node(tmp_path, node_config(database.dsn, "alpha", models(mark=1)))
        with daemon.client() as c:
            assert np.asarray(c.embed("direct", model="m")).tolist() == expected("direct", 1)
            started = time.monotonic()
            with pytest.raises(PoolError) as refused:
                c.submit("embed", "queued", model="m")
            assert refused.value.code is ErrorCode.UNAVAILABLE
            assert time.monotonic() - started < 10
            assert "PostgreSQL" in refused.value.message
            assert c.status()["cluster"]["reachable"] is False
    finally:
        database.server.start()
    try:
        with daemon.client() as c:  # reconnects on its own, with back-off
            key = wait_until(lambda: _submitted(c, "after"), 30, "submit once the server is up")
            assert np.asarray(c.retrieve(key, 20)).tolist() == expected("after", 1)
    finally:
        assert daemon.stop() == 0, daemon.log()


def _submitted(client: object, text: str) -> str | None:
    try:
        return client.submit("embed", text, model="m")  # type: ignore[attr-defined,no-any-return]
    except PoolError as exc:
        assert exc.code is ErrorCode.UNAVAILABLE
        return None


def test_a_postgres_crash_mid_run_loses_no_job(tmp_path: Path, database: Database) -> None:
    database.durable_commits()  # what was acknowledged survives the crash
    daemon = start_node(tmp_path, node_config(database.dsn, "alpha", models(1, run_s=0.02)))
    try:
        with daemon.client() as c:
            wait_until(lambda: c.status()["cluster"]["reachable"], 20, "the node connects")
            texts = [f"job {i}" + "x" * (i % 7) for i in range(150)]
            keys = [c.submit("embed", t, model="m") for t in texts]
            wait_until(lambda: _done(database) >= 10, 30, "some jobs done")
            database.server.kill()  # as a crash: backends gone, connections broken
            time.sleep(1.0)  # jobs end meanwhile; their results wait to be stored
            database.server.start()
            wait_until(lambda: _done(database) == len(keys), 60, "every job done")
            results = [c.retrieve(key, 20) for key in keys]
        assert [np.asarray(r).tolist() for r in results] == [expected(t, 1) for t in texts]
    finally:
        assert daemon.stop() == 0, daemon.log()


def _done(database: Database) -> int:
    try:
        rows = database.query("SELECT count(*) FROM modelpool.jobs WHERE state = 'done'")
    except Exception:  # the server is coming back
        return 0
    return int(rows[0][0])  # type: ignore[call-overload]


def test_a_node_claims_no_job_of_a_model_that_waits_for_its_export(
        tmp_path: Path, database: Database,
        hold_minilm_export: Callable[..., AbstractContextManager[None]]) -> None:
    cache = tmp_path / "empty-cache"
    with hold_minilm_export(cache, found_made=True):  # the node's export waits meanwhile
        daemon = start_node(tmp_path / "alpha", node_config(database.dsn, "alpha",
                                                            FORCED_MINILM),
                            env={"MODELPOOL_CACHE_DIR": str(cache)})
        try:
            with daemon.client() as c:
                wait_until(lambda: c.status()["cluster"]["reachable"], 20, "the node connects")
                key = c.submit("embed", "hello", model="minilm")
                time.sleep(3)  # a notification and three ticks' claim rounds
            # Left in the shared queue for a node that can start the model now.
            assert database.query("SELECT node, state FROM modelpool.jobs WHERE key = %s",
                                  (key,)) == [("", "queued")]
        except BaseException:
            daemon.stop()
            raise
    try:
        with daemon.client() as c:  # the export is made: the node claims and runs it
            assert np.asarray(c.retrieve(key, timeout_s=300)).shape == (384,)
        assert database.query("SELECT node, state FROM modelpool.jobs WHERE key = %s",
                              (key,)) == [("alpha", "done")]
    finally:
        assert daemon.stop() == 0, daemon.log()
