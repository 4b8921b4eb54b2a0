"""A real PostgreSQL server for the cluster suite (one per session, run as the postgres
user; a fresh database per test), and `async def` tests run under asyncio.run."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import pg
import pytest

ASYNC_TEST_TIMEOUT_S = 60.0
_databases = itertools.count()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S))
    return True


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

    def query(self, sql: str, params: object = ()) -> list[tuple[object, ...]]:
        with self.server.connect(dbname=self.name) as conn:
            return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


@pytest.fixture
def database(pg_server: pg.PgServer) -> Database:
    """A fresh, empty database of the session's server, for one test."""
    return Database(pg_server, pg_server.create_database(f"t{next(_databases)}"))
