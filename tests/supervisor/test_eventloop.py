"""The event loop the daemon runs on: uvloop where installed unless asyncio's is asked
for; "uvloop" without it is a config error. A process whose loop has stopped ends
without freeing its heap."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from modelpool.supervisor import eventloop
from modelpool.supervisor.config import ConfigError, load_config


async def _name() -> str:
    await asyncio.sleep(0)
    return eventloop.running_loop_name()


def test_auto_runs_uvloop_when_installed_and_asyncio_on_request() -> None:
    pytest.importorskip("uvloop", reason="uvloop is not installed here")
    assert eventloop.run(_name(), "auto") == "uvloop"
    assert eventloop.run(_name(), "uvloop") == "uvloop"
    assert eventloop.run(_name(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert eventloop.run(_name(), "auto") == "asyncio"
    path = tmp_path / "modelpool.toml"
    path.write_text('[daemon]\nevent_loop = "uvloop"\n')
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        load_config(path)
    path.write_text('[daemon]\nevent_loop = "asyncio"\n')
    assert load_config(path).daemon.event_loop == "asyncio"


def test_an_unknown_loop_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "modelpool.toml"
    path.write_text('[daemon]\nevent_loop = "trio"\n')
    with pytest.raises(ConfigError, match=r"\$\.daemon\.event_loop"):
        load_config(path)


# A stopped process's exit, in a process of its own: a module-level object is freed only
# by the interpreter's teardown, an exit handler runs before it.
STOPPED_PROCESS_EXITS = """
import atexit, sys, threading, time
from modelpool.supervisor.eventloop import exit_without_teardown

class Freed:
    def __del__(self):
        print("heap freed", flush=True)

kept = Freed()
atexit.register(print, "exit handler ran", flush=True)
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(0.5,)).start()  # Python's exit waits for it
sys.exit(exit_without_teardown(3))
"""


@pytest.mark.parametrize(("running", "lines"), [
    ("none", ["exit handler ran"]),
    ("thread", ["exit handler ran", "heap freed"]),
])
def test_a_stopped_process_exits_without_freeing_its_heap(running: str,
                                                           lines: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", STOPPED_PROCESS_EXITS, running],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == lines
