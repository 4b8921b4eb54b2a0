"""A worker's state moves only along the allowed transitions; its pipe hands on each
whole frame, and stops at one it cannot read; its exit is reported once it can be reaped."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelpool.protocol.framing import HEADER, MAX_FRAME_BYTES, frame
from modelpool.protocol.messages import encoder
from modelpool.protocol.pipes import Ready, WantWork, from_worker_decoder
from modelpool.registry.loaders import ONNX_MODULES, TORCH_PRELOAD
from modelpool.supervisor.eventloop import loop_factory
from modelpool.supervisor.workers import (
    IllegalTransition,
    Pipe,
    WorkerHandle,
    WorkerState,
    starts_fresh,
)

S = WorkerState


def handle(state: WorkerState) -> WorkerHandle:
    worker = WorkerHandle(worker_id=1, model_key="m", started_at=0.0)
    worker.state = state
    return worker


@pytest.mark.parametrize(("start", "end"), [
    (S.STARTING, S.LOADING), (S.LOADING, S.IDLE), (S.IDLE, S.BUSY), (S.BUSY, S.IDLE),
    (S.LOADING, S.HOLDING), (S.BUSY, S.STOPPING), (S.STOPPING, S.DEAD), (S.STARTING, S.DEAD),
])
def test_allowed_moves(start: WorkerState, end: WorkerState) -> None:
    worker = handle(start)
    worker.move_to(end)
    assert worker.state is end


@pytest.mark.parametrize(("start", "end"), [
    (S.DEAD, S.IDLE), (S.STOPPING, S.IDLE), (S.IDLE, S.LOADING), (S.HOLDING, S.BUSY),
    (S.STARTING, S.BUSY), (S.IDLE, S.IDLE), (S.DEAD, S.DEAD),
])
def test_impossible_moves_are_refused(start: WorkerState, end: WorkerState) -> None:
    worker = handle(start)
    with pytest.raises(IllegalTransition):
        worker.move_to(end)
    assert worker.state is start


async def _through_pipe(chunks: list[bytes]) -> tuple[list[Any], list[str]]:
    """What a Pipe delivers and refuses when a worker writes chunks, one at a time."""
    delivered: list[Any] = []
    refused: list[str] = []
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_unix_connection(
        lambda: Pipe(from_worker_decoder, delivered.append, refused.append), sock=ours)
    try:
        for chunk in chunks:
            theirs.sendall(chunk)
            await asyncio.sleep(0.02)  # each chunk its own read
    finally:
        theirs.close()
        transport.close()
    return delivered, refused


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pipe_delivers_frames_cut_anywhere_then_stops_at_garbage(loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed here")
    ready = frame(encoder.encode(Ready(pid=7, load_s=0.5)))
    want = frame(encoder.encode(WantWork()))
    stream = ready + want + want
    chunks = [stream[:3], stream[3:len(ready) + 2], stream[len(ready) + 2:],
              frame(b"\xc1 not msgpack"), want]
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:  # type: ignore[arg-type]
        delivered, refused = runner.run(_through_pipe(chunks))
    assert delivered == [Ready(pid=7, load_s=0.5), WantWork(), WantWork()]
    assert len(refused) == 1  # and nothing after the garbage was read


def test_pipe_refuses_a_frame_over_the_limit() -> None:
    delivered, refused = asyncio.run(_through_pipe([HEADER.pack(MAX_FRAME_BYTES + 1)]))
    assert delivered == []
    assert refused == [f"frame of {MAX_FRAME_BYTES + 1} bytes exceeds the limit of "
                       f"{MAX_FRAME_BYTES} bytes"]


# A process of its own: the forkserver is one per process, and pytest's must stay as it is.
FORKSERVER_CLOSED = """
import asyncio, pathlib, sys, time
from modelpool.supervisor.workers import Launcher

async def main():
    launcher = Launcher(["ends_quietly"])
    await launcher.warm_up()
    imported = pathlib.Path(sys.argv[1], "imported")
    deadline = time.monotonic() + 30
    while not imported.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await launcher.close(grace_s=30)
    print("closed after the preload" if imported.exists() else "not preloaded")

asyncio.run(main())
"""
PRELOAD = """
import atexit, pathlib
here = pathlib.Path(__file__).parent
atexit.register((here / "torn-down").write_text, "freed its heap")
(here / "imported").write_text("")
"""


def test_the_forkserver_ends_at_once_without_its_exit_handlers(tmp_path: Path) -> None:
    """Its preloaded heap (torch's) is not freed object by object at every stop: an exit
    handler of a preloaded module never runs, as for a process ended by a signal."""
    (tmp_path / "ends_quietly.py").write_text(PRELOAD)
    done = subprocess.run([sys.executable, "-c", FORKSERVER_CLOSED, str(tmp_path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})  # the forkserver's
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "closed after the preload"
    assert not (tmp_path / "torn-down").exists()


# A fresh interpreter's sentinel is a pipe whose end it holds: closed as it exits, a moment
# before the process can be reaped. This child closes it early and lives on a while, so
# that the moment is long on any machine.
EXITS_LATE = """
import os, time

def close_fds_then_exit() -> None:
    os.closerange(3, 4096)
    time.sleep(0.3)
    os._exit(3)
"""
REAPED = """
import asyncio, multiprocessing
from exits_late import close_fds_then_exit
from modelpool.supervisor.workers import Launcher, WorkerHandle

class Events:
    def __init__(self):
        self.exited = asyncio.get_running_loop().create_future()

    def handle_exit(self, handle, exitcode):
        self.exited.set_result(exitcode)

async def main():
    launcher = Launcher([])
    launcher.events = events = Events()
    process = multiprocessing.get_context("spawn").Process(target=close_fds_then_exit)
    process.start()
    handle = WorkerHandle(worker_id=1, model_key="m", started_at=0.0, process=process)
    asyncio.get_running_loop().add_reader(process.sentinel, launcher._exited, handle)
    print("exit code", await asyncio.wait_for(events.exited, 30))

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_worker_whose_sentinel_closes_before_it_exits_is_reaped_once_it_has(
        tmp_path: Path) -> None:
    (tmp_path / "exits_late.py").write_text(EXITS_LATE)
    (tmp_path / "reaped.py").write_text(REAPED)
    done = subprocess.run([sys.executable, str(tmp_path / "reaped.py")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exit code 3"


def test_a_worker_starts_fresh_only_to_skip_the_torch_it_does_not_need() -> None:
    llm = [TORCH_PRELOAD, "modelpool.registry.loaders.causal_lm"]
    onnx = list(ONNX_MODULES)
    assert starts_fresh([*llm, *onnx], onnx)  # MiniLM's export, beside an LLM
    assert not starts_fresh([*llm, *onnx], llm)  # the LLM: it would import torch itself
    assert not starts_fresh(onnx, onnx)  # a forkserver without torch is ready in a moment
    assert starts_fresh([*llm, "modelpool.workers.preload_loaders"],
                        ["modelpool.workers.preload_loaders"])  # a custom loader's own
