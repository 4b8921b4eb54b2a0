"""Real daemons for the adversarial scripts: tests/integration's helpers (a daemon
started in a directory of its own, acting as another user), loaded by path."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def integration() -> ModuleType:
    """tests/integration/conftest.py (real daemons, another user), loaded by path as
    tests/adversarial/adversarial_helpers.py does."""
    name = "_modelpool_integration_conftest"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "tests" / "integration" / "conftest.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks itself up there
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextlib.contextmanager
def serving(config: str) -> Iterator[Any]:
    """A daemon serving config; stopped, and whatever it left killed, on exit."""
    workdir = tempfile.mkdtemp(prefix="mpadv-")
    daemon = integration().start_daemon(Path(workdir), config)
    try:
        yield daemon
    finally:
        children = daemon.descendants()
        with contextlib.suppress(Exception):
            daemon.stop()
        for child in children:
            with contextlib.suppress(Exception):
                child.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def model_status(status: dict[str, Any], key: str) -> dict[str, Any]:
    return next(m for m in status["models"] if m["key"] == key)
