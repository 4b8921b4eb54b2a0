"""Two daemons on one PostgreSQL whose configs name different models: a request that
reaches either, directly or as a job, for a model only the other names (by its key or
an alias) runs on the other, through the socket and the OpenAI HTTP API; a key both
name but configure otherwise is pointed out, and each runs only its own work of it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
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


def embedder(key: str, mark: int, aliases: str = "[]", run_s: float = 0,
             device: str = "auto") -> str:
    return f"""
    [[models]]
    key = "{key}"
    aliases = {aliases}
    capability = "text_embedding"
    loader = "mp_test_loaders:slow_embedder"
    options = {{ mark = {mark}, run_s = {run_s} }}
    max_workers = 1
    device = "{device}"
"""


@pytest.fixture
def two_nodes(tmp_path: Path, database: Database,
              beta_http: str) -> Iterator[tuple[Daemon, Daemon]]:
    """alpha names m (alias em), beta n; both name s (a pass of 0.1 s) and t, with other
    options, and beta cannot run its t (no GPU). beta also serves the HTTP API (open:
    loopback only)."""
    http = f'\n[http]\nlisten = "{beta_http.removeprefix("http://")}"\n'
    with nodes_seeing_each_other(
            lambda: start_node(tmp_path / "alpha", node_config(
                database.dsn, "alpha", embedder("m", 1, '["em"]') + embedder("s", 1, run_s=0.1)
                + embedder("t", 1))),
            lambda: start_node(tmp_path / "beta", node_config(
                database.dsn, "beta", embedder("n", 2) + embedder("s", 2, run_s=0.1)
                + embedder("t", 2, device="cuda")) + http),
    ) as (alpha, beta):
        yield alpha, beta


def vector(text: str, mark: int) -> list[float]:
    return [float(len(text)), *map(float, range(1, DIM - 1)), float(mark)]


def test_a_model_only_another_node_names_is_served_there_by_key_or_alias(
        two_nodes: tuple[Daemon, Daemon], database: Database) -> None:
    alpha, beta = two_nodes
    with beta.client() as c:
        assert np.asarray(c.embed("direct", model="m")).tolist() == vector("direct", 1)
        assert np.asarray(c.embed("alias", model="EM")).tolist() == vector("alias", 1)
        key = c.submit("embed", "a job", model="em")
        assert np.asarray(c.retrieve(key, timeout_s=60)).tolist() == vector("a job", 1)
        assert c.job(key)["model"] == "m"  # the name it goes by on the node that runs it
        assert np.asarray(c.embed("local", model="n")).tolist() == vector("local", 2)
        status = c.status()
        listed = {m["key"]: m for m in c.models()}
    assert (listed["m"]["state"], listed["m"]["aliases"], listed["m"]["source"]) == (
        "elsewhere", ["em"], "node alpha")
    assert listed["n"]["state"] != "elsewhere"
    assert "m" not in {m["key"] for m in status["models"]}  # nothing of it here
    assert database.query("SELECT DISTINCT node, model FROM modelpool.jobs") == [
        ("alpha", "m")]
    with alpha.client() as c:
        assert model_status(c.status(), "m")["workers"]  # it ran there


def test_an_openai_client_of_one_node_reaches_the_other_nodes_model(
        two_nodes: tuple[Daemon, Daemon], beta_http: str) -> None:
    sdk = openai.OpenAI(base_url=f"{beta_http}/v1", api_key="unused", max_retries=0,
                        timeout=60)

    def answers() -> bool:
        with contextlib.suppress(openai.APIConnectionError):
            return bool(sdk.models.list().data)
        return False

    wait_until(answers, 30, "beta's HTTP API answers")
    got = sdk.embeddings.create(model="em", input=["over http"])
    assert got.data[0].embedding == vector("over http", 1)
    assert {"m", "n"} <= {model.id for model in sdk.models.list()}
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="nobody", input=["x"])


def test_a_request_for_another_nodes_model_is_checked_as_that_node_would(
        two_nodes: tuple[Daemon, Daemon]) -> None:
    alpha, beta = two_nodes
    with beta.client() as c:
        for call, code in ((lambda: list(c.generate("x", model="m")), ErrorCode.WRONG_CAPABILITY),
                           (lambda: c.submit("embed", [], model="m"), ErrorCode.BAD_REQUEST),
                           (lambda: c.embed("x", model="nobody"), ErrorCode.UNKNOWN_MODEL)):
            with pytest.raises(PoolError) as refused:
                call()
            assert refused.value.code is code, refused.value
    assert alpha.stop() == 0, alpha.log()
    with beta.client() as c:
        wait_until(lambda: len(c.status()["cluster"]["nodes"]) == 1, 30, "alpha is gone")
        with pytest.raises(PoolError) as gone:
            c.embed("x", model="m")  # no live node names it now
    assert gone.value.code is ErrorCode.UNKNOWN_MODEL


def test_a_key_two_nodes_configure_otherwise_is_pointed_out(
        two_nodes: tuple[Daemon, Daemon]) -> None:
    alpha, beta = two_nodes
    with beta.client() as c:
        wait_until(lambda: c.status()["cluster"]["differs"] == {"s": ["alpha"],
                                                                 "t": ["alpha"]}, 10,
                   "beta sees that alpha's s and t are not its own")
    shown = subprocess.run(
        [sys.executable, "-m", "modelpool.supervisor.cli", "status", "--socket",
         beta.socket_path], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "s is configured otherwise on alpha than here" in shown
    assert "model s is configured otherwise on alpha than here" in beta.log()
    with alpha.client() as c:
        assert c.status()["cluster"]["differs"] == {"s": ["beta"], "t": ["beta"]}


def test_each_node_runs_only_its_own_work_of_a_key_they_configure_otherwise(
        two_nodes: tuple[Daemon, Daemon], database: Database) -> None:
    """alpha's s loaded and idle: without its own variant on each job, beta's queued
    jobs of s, and its direct request while it has no worker of s, would run there."""
    alpha, beta = two_nodes
    with alpha.client() as c:
        assert np.asarray(c.embed("warm", model="s")).tolist() == vector("warm", 1)
    with beta.client() as c:
        wait_until(lambda: "s" in c.status()["cluster"]["differs"] and any(
            node["name"] == "alpha" and node["models"].get("s", {}).get("idle")
            for node in c.status()["cluster"]["nodes"]), 10, "beta sees alpha's s idle")
        assert np.asarray(c.embed("direct", model="s")).tolist() == vector("direct", 2)
        keys = [c.submit("embed", f"job {i}", model="s") for i in range(24)]
        results = [np.asarray(c.retrieve(key, timeout_s=60)).tolist() for key in keys]
        with pytest.raises(PoolError) as refused:
            c.submit("embed", "x", model="t")  # only alpha can run a t, and not beta's
    assert results == [vector(f"job {i}", 2) for i in range(24)]
    assert database.query("SELECT DISTINCT node FROM modelpool.jobs WHERE model = 's'") == [
        ("beta",)]
    assert refused.value.code is ErrorCode.MODEL_LOAD_FAILED and "GPU" in refused.value.message
