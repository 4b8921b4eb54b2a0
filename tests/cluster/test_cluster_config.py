"""The [cluster] settings as a daemon acts on them: $MODELPOOL_POSTGRES in place of
`postgres`, the host name as the default `node_name`, and `route_remote = false` (a
direct request stays here; one for a model only another node names is refused saying
so, and runs there as a job)."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    Database,
    model_entry,
    model_status,
    node_config,
    peer_serves,
    start_node,
    wait_until,
)

from modelpool.protocol.errors import ErrorCode, PoolError


def test_modelpool_postgres_makes_a_node_named_after_its_host(
        tmp_path: Path, database: Database) -> None:
    config = "[pool]\ncold_start_workers = 1\n" + model_entry("m", mark=1)  # no [cluster]
    daemon = start_node(tmp_path, config, env={"MODELPOOL_POSTGRES": database.dsn})
    try:
        with daemon.client() as c:
            assert c.status()["cluster"] is not None, "the environment made no cluster node"
            wait_until(lambda: c.status()["cluster"]["reachable"], 20, "the node connects")
            key = c.submit("embed", "via the environment", model="m")
            vector = np.asarray(c.retrieve(key, 20)).tolist()
            node = c.status()["cluster"]["node"]
    finally:
        assert daemon.stop() == 0, daemon.log()
    host = socket.gethostname()
    assert vector[0] == len("via the environment")
    assert node == host
    assert database.query("SELECT name FROM modelpool.nodes") == [(host,)]
    assert database.query("SELECT node, state FROM modelpool.jobs WHERE key = %s",
                          (key,)) == [(host, "done")]


def test_with_route_remote_off_a_direct_request_loads_here_while_another_node_serves(
        tmp_path: Path, database: Database) -> None:
    # One config of warm on both (a would not route to b's otherwise); the vectors' last
    # element says which daemon computed them.
    b = start_node(tmp_path / "b", node_config(database.dsn, "b", model_entry("warm")
                                               + model_entry("only_b")),
                   env={"MP_TEST_MARK": "2"})
    a = start_node(tmp_path / "a", node_config(database.dsn, "a", model_entry("warm"),
                                                cluster_extra="route_remote = false"),
                   env={"MP_TEST_MARK": "1"})
    try:
        with b.client() as cb:
            assert np.asarray(cb.embed("warm up", model="warm")).tolist()[-1] == 2
        with a.client() as ca:
            # What routing needs: b serves the model with room, a has no worker for it.
            wait_until(lambda: peer_serves(ca.status(), "b", "warm"), 20, "a sees b serve it")
            assert model_status(ca.status(), "warm")["workers"] == []
            vector = np.asarray(ca.embed("asked of a", model="warm")).tolist()
            workers = model_status(ca.status(), "warm")["workers"]
            with pytest.raises(PoolError) as kept:  # a model only b's config names
                ca.embed("x", model="only_b")
            job = ca.submit("embed", "as a job", model="only_b")  # which b runs
            assert np.asarray(ca.retrieve(job, 60)).tolist()[-1] == 2
    finally:
        for daemon in (a, b):
            assert daemon.stop() == 0, daemon.log()
    assert vector[0] == len("asked of a")
    assert vector[-1] == 1  # a ran it (routed, b's worker would have: 2)
    assert [w["state"] for w in workers] == ["idle"]  # a loaded the model for it
    assert kept.value.code is ErrorCode.UNKNOWN_MODEL
    assert "route_remote = false" in kept.value.message and "submit it as a job" in \
        kept.value.message
