"""Custom loaders for integration tests, plugged in through the product's `loader = ...`
model option: slow, failing and crashing models without test-only switches in modelpool.

Imported inside worker processes (the test daemon has this directory on PYTHONPATH).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from modelpool.protocol.messages import Generate, TokenLogprob
from modelpool.registry.loaders.reasoning import ReasoningReader
from modelpool.registry.loaders.tool_calls import FORMATS, ToolCallReader, reader_for
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats

DIM = 8


class SlowEmbedder:
    """Embeds text as a deterministic vector after run_s seconds; "CRASH" kills the worker.
    With a log path, appends every text it runs to that file (one per line). A `mark`
    becomes the vector's last element, to tell which daemon computed it."""

    def __init__(self, run_s: float, log: str | None = None, mark: float = DIM - 1) -> None:
        self.run_s = run_s
        self.log = log
        self.mark = mark

    def info(self) -> dict[str, Any]:
        return {"dim": DIM}

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if any(t == "CRASH" for t in texts):
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.log:
            with open(self.log, "a") as log:
                log.writelines(f"{t}\n" for t in texts)
        time.sleep(self.run_s)
        rows = [[float(len(t))] + [float(i) for i in range(1, DIM - 1)] + [self.mark]
                for t in texts]
        return np.asarray(rows, dtype=np.float32)


class CountingGenerator:
    """Streams "tok0 tok1 ..." one token per step_s seconds; with think_tokens, as a
    reasoning model, the first that many between <think> and </think>."""

    writes_calls = False

    def __init__(self, step_s: float, think_tokens: int = 0) -> None:
        self.step_s = step_s
        self.think_tokens = think_tokens

    def info(self) -> dict[str, Any]:
        return {"context": 1 << 20}

    def reasoning_reader(self, request: Generate) -> ReasoningReader | None:
        return ReasoningReader(inside=False) if self.think_tokens else None

    def generate(self, request: Generate, stats: GenerationStats) -> Iterator[str]:
        stats.prompt_tokens = len(request.prompt.split())
        call = _call(request.tools) if self.writes_calls and request.tool_choice == "auto" \
            else None
        for i in range(request.sampling.max_tokens or 0):
            if call is not None and i == len(call):
                stats.finish_reason = "stop"
                return
            time.sleep(self.step_s)
            stats.completion_tokens += 1
            stats.logprob = _entry(request, i)
            if call is not None:
                yield call[i]
                continue
            tags = ("<think>" if i == 0 and self.think_tokens else "") + (
                "</think>" if i == self.think_tokens > 0 else "")
            yield f"{tags}tok{i} "
        stats.finish_reason = "length"


class CallingGenerator(CountingGenerator):
    """A CountingGenerator that, with tool_choice "auto", writes "tok0 " then a call of
    the first tool in Hermes' format, an argument a token (CALL_ARGUMENTS of them), and
    stops."""

    writes_calls = True

    def tool_reader(self, request: Generate) -> ToolCallReader | None:
        if request.tool_choice != "auto":
            return None
        return reader_for(FORMATS["hermes"], "counting", request.tools)


CALL_ARGUMENTS = 4


def _call(tools: list[dict[str, Any]]) -> list[str]:
    """A Hermes call of the first tool, as tokens."""
    name = tools[0]["function"]["name"]
    return ["tok0 ", f'<tool_call>{{"name": "{name}", "arguments": {{',
            *(f'{", " if i else ""}"n{i}": {i}' for i in range(CALL_ARGUMENTS)),
            "}}</tool_call>"]


def _entry(request: Generate, i: int) -> TokenLogprob | None:
    """Token i's stand-in entry (log-probability -i), when the request asks for them."""
    if request.sampling.logprobs is None:
        return None
    return TokenLogprob(f"tok{i} ", i, -float(i))


def slow_embedder(spec: ModelSpec, model_dir: Path | None) -> SlowEmbedder:
    """Its vectors end with a mark: its `mark` option, or $MP_TEST_MARK, which tells
    which daemon of a cluster computed one without configuring the model otherwise
    there (a model configured otherwise is another model: no other node runs its jobs)."""
    time.sleep(float(spec.options.get("load_s", 0)))
    if silent_s := int(spec.options.get("silent_load_s", 0)):
        # libc's sleep through PyDLL, which keeps the GIL: as a long C call of a real
        # load does (a dlopen), it keeps the heartbeat thread from beating meanwhile.
        ctypes.PyDLL(None).sleep(silent_s)
    mark = spec.options.get("mark", os.environ.get("MP_TEST_MARK", DIM - 1))
    return SlowEmbedder(float(spec.options.get("run_s", 0)), spec.options.get("log"),
                        float(mark))


def counting_generator(spec: ModelSpec, model_dir: Path | None) -> CountingGenerator:
    time.sleep(float(spec.options.get("load_s", 0)))
    return CountingGenerator(float(spec.options.get("step_s", 0.01)),
                             int(spec.options.get("think_tokens", 0)))


def calling_generator(spec: ModelSpec, model_dir: Path | None) -> CallingGenerator:
    return CallingGenerator(float(spec.options.get("step_s", 0.01)))


def failing(spec: ModelSpec, model_dir: Path | None) -> None:
    raise RuntimeError("boom: this loader always fails")


class SlowImageEmbedder:
    """Embeds images as their sizes after run_s seconds (no text tower)."""

    def __init__(self, run_s: float) -> None:
        self.run_s = run_s

    def info(self) -> dict[str, Any]:
        return {"dim": DIM}

    def embed_images(self, images: Sequence[Any]) -> np.ndarray:
        time.sleep(self.run_s)
        return np.asarray([[float(i.width), float(i.height)] + [0.0] * (DIM - 2)
                           for i in images], dtype=np.float32)


def slow_image_embedder(spec: ModelSpec, model_dir: Path | None) -> SlowImageEmbedder:
    return SlowImageEmbedder(float(spec.options.get("run_s", 0)))


@dataclass
class Emitted:
    """One step's outcome for one stream, as workers/streams.py reads it."""

    seq_id: int
    text: str = ""
    logprob: TokenLogprob | None = None
    stats: GenerationStats | None = None
    error: BaseException | None = None


class CountingDecoder:
    """Continuous batching without a model: every stream gets "tok<i> " each step, all of
    them in one step of step_s seconds; a stream ends after its max_tokens."""

    def __init__(self, step_s: float, max_sequences: int) -> None:
        self.step_s = step_s
        self.default_max_sequences = max_sequences
        self.streams: dict[int, tuple[Generate, GenerationStats]] = {}

    def __len__(self) -> int:
        return len(self.streams)

    def add(self, seq_id: int, request: Generate) -> None:
        self.streams[seq_id] = (request, GenerationStats(
            prompt_tokens=len(request.prompt.split())))

    def drop(self, seq_id: int) -> GenerationStats | None:
        entry = self.streams.pop(seq_id, None)
        return entry[1] if entry else None

    def step(self) -> list[Emitted]:
        time.sleep(self.step_s)
        events = []
        for seq_id, (request, stats) in list(self.streams.items()):
            event = Emitted(seq_id, f"tok{stats.completion_tokens} ",
                            _entry(request, stats.completion_tokens))
            stats.completion_tokens += 1
            if stats.completion_tokens >= (request.sampling.max_tokens or 0):
                stats.finish_reason, event.stats = "length", stats
                del self.streams[seq_id]
            events.append(event)
        return events


class BatchedCounter(CountingGenerator):
    """CountingGenerator whose streams a worker batches continuously (the decoder above)."""

    def __init__(self, step_s: float, max_sequences: int) -> None:
        super().__init__(step_s)
        self.max_sequences = max_sequences

    def prepare(self, request: Generate) -> Generate:
        if request.prompt == "CRASH":
            os.kill(os.getpid(), signal.SIGKILL)
        return request

    def decoder(self) -> CountingDecoder:
        return CountingDecoder(self.step_s, self.max_sequences)


def batched_counter(spec: ModelSpec, model_dir: Path | None) -> BatchedCounter:
    return BatchedCounter(float(spec.options.get("step_s", 0.01)),
                          int(spec.options.get("max_sequences", 8)))
