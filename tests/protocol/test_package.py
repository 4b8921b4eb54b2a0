"""Installed, the project is one package: `modelpool`, with the repository's folders
beneath it. Nothing with a generic name (supervisor, protocol, ...) is importable at the
top level, where it would clash with other distributions (supervisord's `supervisor`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CHECK = """
import importlib.util
clashes = [n for n in ("supervisor", "protocol", "workers", "registry")
           if importlib.util.find_spec(n) is not None]
from modelpool import AsyncClient, Client, ErrorCode, PoolError
print(clashes, Client.__module__, AsyncClient.__module__, PoolError.__name__, ErrorCode.TIMEOUT)
"""


def test_only_modelpool_is_installed_at_the_top_level(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[]", "modelpool.protocol.client",
                                  "modelpool.protocol.async_client", "PoolError", "TIMEOUT"]


def test_importing_the_package_does_not_import_the_client() -> None:
    code = ("import sys, modelpool; "
            "print('numpy' in sys.modules, 'modelpool.protocol' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_modelpool_command_is_installed() -> None:
    command = shutil.which("modelpool", path=str(Path(sys.executable).parent))
    assert command is not None
    out = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout
