"""Helpers of the cluster suite: a real PostgreSQL server (one per session, run as the
postgres user; a fresh database per test), a daemon as a cluster node (its config,
started in a network namespace or not).

pytest imports every folder's conftest.py as the module `conftest`, so the integration
suite's (real daemons) is loaded here by path under its own name and the tests import
this module by its unique name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import socket
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pg
import pytest

_NAME = "_modelpool_integration_conftest"


def _integration_conftest() -> ModuleType:
    if _NAME in sys.modules:  # the adversarial suite may have loaded it already
        return sys.modules[_NAME]
    path = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


_integration = _integration_conftest()
Daemon = _integration.Daemon
FORCED_MINILM = _integration.FORCED_MINILM
model_entry = _integration.model_entry
start_daemon = _integration.start_daemon
wait_until = _integration.wait_until

LEASE_S = 2.0  # short leases, so that the tests of lost nodes are quick


def node_config(dsn: str, name: str, models: str, lease_s: float = LEASE_S,
                extra: str = "", cluster_extra: str = "") -> str:
    """A node's config: `cluster_extra` (one line) goes into [cluster], `extra` (one
    line) into [pool]."""
    return textwrap.dedent(f"""
        [cluster]
        postgres = "{dsn}"
        node_name = "{name}"
        lease_s = {lease_s}
        {cluster_extra}
        [pool]
        cold_start_workers = 1
        {textwrap.dedent(extra)}
    """) + textwrap.dedent(models)


def model_at_path(key: str, path: Path) -> str:
    """A [[models]] entry of a model named by its files' path (a test loader's)."""
    return f"""
    [[models]]
    key = "{key}"
    capability = "text_embedding"
    path = "{path}"
    loader = "mp_test_loaders:slow_embedder"
    max_workers = 1
"""


def start_node(workdir: Path, config: str, prefix: list[str] | None = None,
               env: dict[str, str] | None = None) -> Any:
    """A daemon as a cluster node, in its own directory (config, log); `env` is added to
    the daemon's environment."""
    workdir.mkdir(parents=True, exist_ok=True)
    return start_daemon(workdir, config, env=env, prefix=prefix or ())


@contextlib.contextmanager
def nodes_seeing_each_other(*starts: Callable[[], Any]) -> Iterator[list[Any]]:
    """Nodes started in turn, given once each sees all the others; every one started is
    stopped after (exit status 0), the first ones too when a later one fails to start."""
    daemons: list[Any] = []
    try:
        for start in starts:
            daemons.append(start())
        for daemon in daemons:
            with daemon.client() as c:
                wait_until(lambda c=c: len(c.status()["cluster"]["nodes"]) == len(starts),
                           30, "the nodes see each other")
        yield daemons
    finally:
        for daemon in daemons:
            assert daemon.stop() == 0, daemon.log()


def model_status(status: dict[str, Any], key: str) -> dict[str, Any]:
    """One model's entry in a daemon's status."""
    return next(m for m in status["models"] if m["key"] == key)


def peer_serves(status: dict[str, Any], node: str, key: str) -> bool:
    """The daemon whose status this is sees `node` serve the model (a ready worker)."""
    for peer in status["cluster"]["nodes"]:
        if peer["name"] == node and peer["models"].get(key, {}).get("ready"):
            return True
    return False


_databases = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg.PgServer]:
    reason = pg.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    server = pg.PgServer()
    try:
        server.init()
        yield server
    finally:
        server.destroy()


@dataclass(frozen=True)
class Database:
    server: pg.PgServer
    name: str

    @property
    def dsn(self) -> str:
        return self.server.dsn(dbname=self.name)

    def dsn_at(self, host: str) -> str:
        return self.server.dsn(host, dbname=self.name)

    def durable_commits(self) -> None:
        """Commits acknowledged only once written, as a server's default: the throwaway
        server's synchronous_commit = off would let a crash lose the last ones (see
        pg.DEFAULT_SETTINGS). For the sessions that connect after this call."""
        with self.server.connect(dbname="postgres", user=pg.SUPERUSER) as conn:
            conn.execute(f'ALTER DATABASE "{self.name}" SET synchronous_commit = on')

    def query(self, sql: str, params: object = ()) -> list[tuple[object, ...]]:
        with self.server.connect(dbname=self.name) as conn:
            return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


@pytest.fixture
def database(pg_server: pg.PgServer) -> Database:
    """A fresh, empty database of the session's server, for one test."""
    return fresh_database(pg_server)


def fresh_database(server: pg.PgServer) -> Database:
    return Database(server, server.create_database(f"t{next(_databases)}"))


def free_http() -> str:
    """The base URL of an HTTP API on a free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def beta_http() -> str:
    """The base URL of beta's HTTP API."""
    return free_http()
