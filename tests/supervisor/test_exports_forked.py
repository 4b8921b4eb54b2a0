"""The daemon's export in a real process forked from a real forkserver: a failed one says
why, in its exit code and the last line it wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A process of its own: the forkserver is one per process, and pytest's must stay as it is.
FAILING_EXPORT = """
import asyncio, sys
from pathlib import Path
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.exports import run_export
from modelpool.supervisor.workers import Launcher

async def main():
    launcher = Launcher([])
    missing = Path(sys.argv[1], "no-such-model")
    spec = ModelSpec(key="broken", capability="text_embedding", path=str(missing))
    print(await run_export(launcher, spec, missing, Path(sys.argv[1], "cache", "entry")))
    await launcher.close()

asyncio.run(main())
"""


@pytest.mark.real_process
def test_a_real_export_process_that_fails_says_why(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", FAILING_EXPORT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outcome = done.stdout.strip()
    assert outcome.startswith("the ONNX export exited with 1: ") and "no-such-model" in outcome
    assert not (tmp_path / "cache" / "entry").exists()
