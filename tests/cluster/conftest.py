"""The cluster suite's fixtures (see cluster_helpers.py), and `async def` tests run under
asyncio.run."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from cluster_helpers import beta_http, database, pg_server

__all__ = ["beta_http", "database", "pg_server"]

ASYNC_TEST_TIMEOUT_S = 60.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S))
    return True
