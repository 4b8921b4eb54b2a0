"""Helpers of the cluster suite: a daemon as a cluster node (its config, started in a
network namespace or not), and reading the shared job table directly.

pytest imports every folder's conftest.py as the module `conftest`, so the integration
suite's (real daemons) is loaded here by path under its own name and the tests import
this module by its unique name.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

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
model_entry = _integration.model_entry
start_daemon = _integration.start_daemon

LEASE_S = 2.0  # short leases, so that the tests of lost nodes are quick


def node_config(dsn: str, name: str, models: str, lease_s: float = LEASE_S,
                extra: str = "") -> str:
    return textwrap.dedent(f"""
        [cluster]
        postgres = "{dsn}"
        node_name = "{name}"
        lease_s = {lease_s}
        [pool]
        cold_start_workers = 1
        {textwrap.dedent(extra)}
    """) + textwrap.dedent(models)


def start_node(workdir: Path, config: str, prefix: list[str] | None = None) -> Any:
    """A daemon as a cluster node, in its own directory (config, log)."""
    workdir.mkdir(parents=True, exist_ok=True)
    return start_daemon(workdir, config, prefix=prefix or ())


def wait_until(check: Callable[[], Any], timeout_s: float, what: str,
               interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(interval_s)


