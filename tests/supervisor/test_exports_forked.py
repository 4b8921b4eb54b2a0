"""The daemon's export in a real process forked from a real forkserver: a failed one says
why, in its exit code and the last line it wrote; one cut short by the daemon's stop goes
quietly."""

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


CANCELLED_EXPORT = """
import asyncio, gc, sys
from pathlib import Path
from modelpool.registry.download import resolve_model_dir
from modelpool.registry.spec import Registry, load_catalog
from modelpool.supervisor.exports import run_export
from modelpool.supervisor.workers import Launcher

async def main():
    launcher = Launcher([])
    minilm = Registry(load_catalog()).resolve("minilm")
    entry = Path(sys.argv[1], "cache", "entry")
    export = asyncio.ensure_future(run_export(launcher, minilm, resolve_model_dir(minilm),
                                              entry))
    while not any(p.name == "modelpool-onnx-export" for p in launcher.ctx.active_children()):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # reading its output
    export.cancel()
    try:
        await export
    except asyncio.CancelledError:
        print("cancelled")
    print(launcher.ctx.active_children())
    await launcher.close()
    gc.collect()  # what asyncio logs of futures dropped unread, it logs now

asyncio.run(main())
"""


@pytest.mark.real_process
def test_an_export_cut_short_by_a_stop_is_killed_and_logs_no_error(tmp_path: Path) -> None:
    """The stop cancels it while it reads the export's output: nothing unread is left
    for asyncio to log ("_GatheringFuture exception was never retrieved")."""
    done = subprocess.run([sys.executable, "-c", CANCELLED_EXPORT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["cancelled", "[]"]  # and its process is gone
    assert "never retrieved" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    assert not (tmp_path / "cache" / "entry").exists()


@pytest.mark.real_process
def test_a_real_export_process_that_fails_says_why(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", FAILING_EXPORT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outcome = done.stdout.strip()
    assert outcome.startswith("the ONNX export exited with 1: ") and "no-such-model" in outcome
    assert not (tmp_path / "cache" / "entry").exists()
