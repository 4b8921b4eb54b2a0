"""Two daemons on one PostgreSQL that name a model by a local path: at different paths
with the same files it is one model (work of it goes to whichever node serves it), with
files that differ it is two (each runs only its own work of it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from cluster_helpers import (
    Database,
    model_at_path,
    model_status,
    node_config,
    nodes_seeing_each_other,
    peer_serves,
    start_node,
    wait_until,
)


def model_files(root: Path, weights: bytes = b"\x01" * 64) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "weights.dat").write_bytes(weights)
    return root


def test_a_model_at_another_path_is_the_same_model_exactly_when_its_files_are(
        tmp_path: Path, database: Database) -> None:
    s_alpha = model_files(tmp_path / "alpha-models" / "s")
    s_beta = tmp_path / "beta-models" / "copy-of-s"
    shutil.copytree(s_alpha, s_beta)
    u_alpha = model_files(tmp_path / "alpha-models" / "u")
    u_beta = model_files(tmp_path / "beta-models" / "u", b"\x02" + b"\x01" * 63)
    # The vectors' last element says which daemon computed them.
    with nodes_seeing_each_other(
            lambda: start_node(tmp_path / "alpha", node_config(
                database.dsn, "alpha", model_at_path("s", s_alpha) + model_at_path("u", u_alpha)),
                env={"MP_TEST_MARK": "1"}),
            lambda: start_node(tmp_path / "beta", node_config(
                database.dsn, "beta", model_at_path("s", s_beta) + model_at_path("u", u_beta)),
                env={"MP_TEST_MARK": "2"}),
    ) as (alpha, beta):
        with alpha.client() as c:
            for key in ("s", "u"):
                assert np.asarray(c.embed("warm", model=key)).tolist()[-1] == 1
        with beta.client() as c:
            wait_until(lambda: peer_serves(c.status(), "alpha", "s")
                       and peer_serves(c.status(), "alpha", "u"), 20, "beta sees alpha serve")
            assert c.status()["cluster"]["differs"] == {"u": ["alpha"]}
            assert model_status(c.status(), "s")["workers"] == []
            # Routed to alpha, which serves s with room, rather than loaded here...
            assert np.asarray(c.embed("asked of beta", model="s")).tolist()[-1] == 1
            # ... but never to alpha's other u.
            assert np.asarray(c.embed("asked of beta", model="u")).tolist()[-1] == 2
