"""A reload on one node of a cluster: the model it adds, known by its files' content, is
run there for the other node's clients; the model it removes is no longer run there;
[cluster]'s routing of direct requests and its lease change at once."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    LEASE_S,
    Database,
    model_at_path,
    model_entry,
    node_config,
    nodes_seeing_each_other,
    start_node,
    wait_until,
)

from modelpool.protocol.client import Client
from modelpool.protocol.errors import ErrorCode, PoolError


def embeds_on_alpha(c: Client, key: str) -> bool:
    """Beta, which does not configure the model, has alpha run it (the vector's mark)."""
    try:
        return np.asarray(c.embed("asked of beta", model=key)).tolist()[-1] == 1
    except PoolError as exc:
        assert exc.code is ErrorCode.UNKNOWN_MODEL  # not yet known to beta
        return False


def test_a_model_added_by_reload_serves_the_cluster_and_a_removed_one_stops(
        tmp_path: Path, database: Database) -> None:
    files = tmp_path / "models" / "fresh"
    files.mkdir(parents=True)
    (files / "config.json").write_text('{"hidden_size": 8}')
    old = model_at_path("old", files.parent)
    with nodes_seeing_each_other(
            lambda: start_node(tmp_path / "alpha", node_config(database.dsn, "alpha", old),
                               env={"MP_TEST_MARK": "1"}),
            lambda: start_node(tmp_path / "beta", node_config(database.dsn, "beta", ""),
                               env={"MP_TEST_MARK": "2"}),
    ) as (alpha, beta):
        with beta.client() as c:
            wait_until(lambda: embeds_on_alpha(c, "old"), 20, "beta's old runs on alpha")
        config = tmp_path / "alpha" / "modelpool.toml"
        config.write_text(textwrap.dedent(node_config(database.dsn, "alpha",
                                                      model_at_path("fresh", files))))
        with alpha.client() as c:
            assert c.reload() == "added: fresh; removed (serving what it has, then stopping): old"
        with beta.client() as c:
            wait_until(lambda: embeds_on_alpha(c, "fresh"), 20, "beta's fresh runs on alpha")
            with pytest.raises(PoolError) as gone:
                wait_until(lambda: not embeds_on_alpha(c, "old"), 20, "old is gone")
                c.embed("again", model="old")
            assert gone.value.code is ErrorCode.UNKNOWN_MODEL
        # [cluster]'s routing applies at once: beta keeps direct requests to itself.
        (tmp_path / "beta" / "modelpool.toml").write_text(textwrap.dedent(node_config(
            database.dsn, "beta", "", cluster_extra="route_remote = false")))
        with beta.client() as c:
            assert c.reload() == "[cluster] applied"
            with pytest.raises(PoolError) as kept:
                c.embed("kept here", model="fresh")
            assert kept.value.code is ErrorCode.UNKNOWN_MODEL
            assert "route_remote = false" in kept.value.message
        # Its files were read for the reload (at the start: old's and the catalogue's MiniLM).
        assert "the files of 1 local model(s) identified" in alpha.log()


def test_a_reloaded_lease_applies_to_the_claim_of_a_job_running_here(
        tmp_path: Path, database: Database) -> None:
    slow = model_entry("slow", run_s=8)  # the job runs across the reload
    with nodes_seeing_each_other(lambda: start_node(
            tmp_path / "alpha", node_config(database.dsn, "alpha", slow))) as (alpha,):

        def lease_left_s() -> float:
            rows = database.query(
                "SELECT extract(epoch FROM lease_until - now()) FROM modelpool.jobs "
                "WHERE key = %s AND state = 'running'", (key,))
            return float(rows[0][0]) if rows else 0.0  # type: ignore[arg-type]

        text = "held across the reload"
        with alpha.client() as c:
            wait_until(lambda: c.status()["cluster"]["reachable"], 20, "alpha connects")
            key = c.submit("embed", text, model="slow")
            wait_until(lambda: lease_left_s() > 0, 30, "alpha runs the job")
            assert lease_left_s() <= LEASE_S
            (tmp_path / "alpha" / "modelpool.toml").write_text(textwrap.dedent(
                node_config(database.dsn, "alpha", slow, lease_s=60)))
            assert c.reload() == "[cluster] applied"
            # Renewed at the next beat (every second) with the new lease.
            wait_until(lambda: lease_left_s() > LEASE_S * 2, 5, "the claim renewed for 60 s")
            # The job ends as it would have: its vector starts with its text's length.
            assert np.asarray(c.retrieve(key, timeout_s=30)).ravel()[0] == len(text)
