"""A generation worker that batches its streams, in a real child process on the tiny
Llama: the slots it grants, one ending per stream, stop strings, aborts and shutdown
of one stream among others. The test plays the supervisor's side of the pipe."""

from __future__ import annotations

import re
import select
import socket
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import recv_frame, send_frame
from modelpool.protocol.messages import Chunk, End, Error, ToolCall, encoder
from modelpool.protocol.pipes import (
    Abort,
    Ready,
    Shutdown,
    Threads,
    WantWork,
    Work,
    WorkerSettings,
    WorkItem,
    from_worker_decoder,
    heartbeat_decoder,
)
from modelpool.registry.loaders import preload_modules
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.workers import forkserver_context
from modelpool.workers import exitcodes
from modelpool.workers.main import run_worker

TIMEOUT_S = 60.0


@dataclass
class Replies:
    """What the worker said, by job id."""

    text: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    seqs: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    endings: dict[int, list[Any]] = field(default_factory=lambda: defaultdict(list))
    logprobs: dict[int, list[Any]] = field(default_factory=lambda: defaultdict(list))
    slots: int = 0  # granted by WantWork


class StreamChild:
    def __init__(self, process: Any, work: socket.socket, beat: socket.socket) -> None:
        self.process, self.work, self.beat = process, work, beat
        self.replies = Replies()

    def beats_until(self, threads: int) -> None:
        """Heartbeats until one says the forward passes use this many threads (those
        sent before the call say what was)."""
        while select.select([self.beat], [], [], 0)[0]:
            recv_frame(self.beat)
        while heartbeat_decoder.decode(recv_frame(self.beat)).threads != threads:
            pass

    def send(self, msg: msgspec.Struct) -> None:
        send_frame(self.work, encoder.encode(msg))

    def read_one(self) -> Any:
        msg = from_worker_decoder.decode(recv_frame(self.work))
        match msg:
            case WantWork(slots=slots):
                self.replies.slots += slots
            case Chunk(id=job, seq=seq, text=text, logprobs=logprobs):
                self.replies.text[job] += text
                self.replies.seqs[job].append(seq)
                self.replies.logprobs[job].extend(logprobs or [])
            case End(id=job) | Error(id=job):
                self.replies.endings[job].append(msg)
        return msg

    def until(self, done: Any) -> None:
        while not done(self.replies):
            self.read_one()

    def exitcode(self) -> int | None:
        self.process.join(TIMEOUT_S)
        return self.process.exitcode


@pytest.fixture
def child(tiny_models_dir: Path) -> Iterator[StreamChild]:
    spec = ModelSpec(key="tiny-llm", capability="text_to_text", max_active_sequences=4,
                     path=str(tiny_models_dir / "tiny-llm"))
    settings = WorkerSettings(worker_id=1, spec=spec, threads=1, heartbeat_interval_s=0.05)
    # As the daemon starts its forkserver for this model: with torch, transformers and
    # Llama's module imported once, not again in every test's worker (~6 s each).
    ctx = forkserver_context(preload_modules([spec]))
    work_parent, work_child = socket.socketpair()
    beat_parent, beat_child = socket.socketpair()
    process = ctx.Process(target=run_worker, daemon=True, name="test-stream-worker",
                          args=(msgspec.msgpack.encode(settings), work_child, beat_child))
    try:
        process.start()
    finally:
        work_child.close()
        beat_child.close()
    work_parent.settimeout(TIMEOUT_S)
    beat_parent.settimeout(TIMEOUT_S)
    handle = StreamChild(process, work_parent, beat_parent)
    ready = handle.read_one()
    assert isinstance(ready, Ready), ready
    assert ready.info["max_active_sequences"] == 4
    assert handle.read_one() == WantWork(slots=4)  # one grant for every sequence
    yield handle
    if process.is_alive():
        process.kill()
    process.join(10)
    work_parent.close()
    beat_parent.close()


def _item(job_id: int, prompt: str, **fields: Any) -> WorkItem:
    request = kinds.build("generate", prompt, raw=True, temperature=0, top_p=1.0, **fields)
    return WorkItem(job_id=job_id, request=request)


def _ended(*jobs: int) -> Any:
    return lambda r: all(r.endings[j] for j in jobs)


def test_streams_share_steps_each_with_its_own_ending(child: StreamChild) -> None:
    child.send(Work(items=[_item(1, "Once upon a time", max_tokens=40, ignore_eos=True)]))
    child.until(_ended(1))
    alone = child.replies.text[1]
    stop = alone[len(alone) // 2:len(alone) // 2 + 3]
    cut = alone[:alone.index(stop)]
    child.until(lambda r: r.slots == 5)  # the slot came back, after the End

    child.send(Work(items=[
        _item(2, "Once upon a time", max_tokens=40, ignore_eos=True),
        _item(3, "Once upon a time", max_tokens=40, ignore_eos=True, stop=[stop]),
        _item(4, "Once upon a time", max_tokens=7, ignore_eos=True),
        _item(5, "x " * 3000, max_tokens=5),  # longer than the context: refused alone
    ]))
    child.until(_ended(2, 3, 4, 5))
    r = child.replies
    assert r.text[2] == alone and r.endings[2][0].finish_reason == "length"
    assert r.text[3] == cut and r.endings[3][0].finish_reason == "stop"
    assert r.endings[4][0].completion_tokens == 7 and alone.startswith(r.text[4])
    assert isinstance(r.endings[5][0], Error)
    assert r.endings[5][0].code is ErrorCode.BAD_REQUEST
    assert all(len(r.endings[j]) == 1 for j in range(1, 6))  # one ending each
    assert all(r.seqs[j] == list(range(len(r.seqs[j]))) for j in range(1, 5))
    child.until(lambda r: r.slots == 9)  # every slot granted back, none twice
    child.send(Shutdown())
    assert child.exitcode() == exitcodes.OK


def test_a_streams_chunks_carry_each_of_its_tokens_logprob_once(child: StreamChild) -> None:
    """Held back by a stop string, then cut by it: the tokens' entries still come, in
    order, each once (a chunk whose text is held back has text "")."""
    child.send(Work(items=[_item(1, "Once upon a time", max_tokens=30, ignore_eos=True,
                                 logprobs=1)]))
    child.until(_ended(1))
    whole, entries = child.replies.text[1], child.replies.logprobs[1]
    assert len(entries) == 30 and all(len(e.top) == 1 for e in entries)
    assert "".join(e.token for e in entries) == whole
    stop = whole[len(whole) // 2:len(whole) // 2 + 4]
    child.send(Work(items=[_item(2, "Once upon a time", max_tokens=30, ignore_eos=True,
                                 logprobs=1, stop=[stop]),
                           _item(3, "Once upon a time", max_tokens=30, ignore_eos=True)]))
    child.until(_ended(2, 3))
    r = child.replies
    assert r.text[2] == whole[:whole.index(stop)] and r.text[3] == whole
    (end,) = r.endings[2]
    assert len(r.logprobs[2]) == end.completion_tokens < 30
    assert r.logprobs[2] == entries[:end.completion_tokens] and not r.logprobs[3]
    child.send(Shutdown())
    assert child.exitcode() == exitcodes.OK


def test_a_streams_tool_calls_come_with_its_end_beside_other_streams(
        child: StreamChild) -> None:
    """Held to a call by a regex (what a model that chose to call writes): with
    tool_choice "auto" its text before the call is streamed and the call comes in the
    End; without, the same output is text; a free stream beside them is untouched."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    said = re.escape("Let me check.\n" + call)
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    chat = [{"role": "user", "content": "weather?"}]
    greedy = {"temperature": 0, "top_p": 1.0}
    child.send(Work(items=[
        WorkItem(job_id=1, request=kinds.build("generate", chat, tools=tools, regex=said,
                                               tool_choice="auto", **greedy)),
        WorkItem(job_id=2, request=kinds.build("generate", chat, tools=tools, regex=said,
                                               **greedy)),
        _item(3, "Once upon a time", max_tokens=20, ignore_eos=True)]))
    child.until(_ended(1, 2, 3))
    r = child.replies
    assert r.text[1] == "Let me check.\n" and r.text[2] == "Let me check.\n" + call
    (end,) = r.endings[1]
    assert end.finish_reason == "tool_calls" and [
        msgspec.structs.replace(c, id="") for c in end.tool_calls or []] == [
        ToolCall(name="get_weather", arguments='{"city":"Paris"}')]
    assert r.endings[2][0].finish_reason == "stop" and r.endings[2][0].tool_calls is None
    assert r.endings[3][0].completion_tokens == 20 and len(r.text[3]) > 0
    child.send(Shutdown())
    assert child.exitcode() == exitcodes.OK


def test_abort_ends_one_stream_and_shutdown_cancels_the_rest(child: StreamChild) -> None:
    long = {"max_tokens": 1900, "ignore_eos": True}
    child.send(Work(items=[_item(j, f"stream {j}", **long) for j in (1, 2, 3)]))
    child.until(lambda r: all(len(r.seqs[j]) >= 3 for j in (1, 2, 3)))
    child.send(Abort(job_id=2))
    child.send(Abort(job_id=99))  # an id it does not have: ignored
    child.until(_ended(2))
    (end,) = child.replies.endings[2]
    assert end.finish_reason == "cancelled" and end.completion_tokens >= 3
    chunks_then = {j: len(child.replies.seqs[j]) for j in (1, 3)}
    child.until(lambda r: all(len(r.seqs[j]) > chunks_then[j] + 3 for j in (1, 3)))
    child.send(Shutdown())
    child.until(_ended(1, 3))
    assert [e.finish_reason for j in (1, 3) for e in child.replies.endings[j]] == [
        "cancelled", "cancelled"]
    assert child.exitcode() == exitcodes.OK


def test_each_grant_of_threads_is_used_from_the_next_step(child: StreamChild) -> None:
    child.beats_until(1)  # its share, as started
    long = {"max_tokens": 1900, "ignore_eos": True}
    child.send(Work(items=[_item(1, "stream", **long)], threads=2))
    child.beats_until(2)  # alone: every core
    child.send(Threads(count=1))  # a sibling started work
    child.send(Threads(count=2))  # ... and finished it
    child.send(Threads(count=1))  # ... and started again
    child.beats_until(1)
    chunks_then = len(child.replies.seqs[1])
    child.until(lambda r: len(r.seqs[1]) > chunks_then + 3)  # the stream goes on
    child.send(Abort(job_id=1))
    child.until(_ended(1))
    child.send(Shutdown())
    assert child.exitcode() == exitcodes.OK
