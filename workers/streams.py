"""A generation worker's loop under continuous batching: up to `max_sequences` streams at
once, stepped together by the model's decoder, one forward pass per step.

Work is accepted between any two steps: the worker grants the supervisor one slot per
free sequence (WantWork(slots=n)), at the start and whenever streams end, so new streams
join at the next step. Each stream keeps its own stop strings, chunk numbering and
ending; an Abort ends one stream and leaves the others running. Every stream gets
exactly one End or Error, as on the one-at-a-time path (text_to_text.stream_text).
"""

from __future__ import annotations

import select
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from modelpool.protocol.messages import End, TokenLogprob, ToolCall
from modelpool.protocol.pipes import (
    Abort,
    Shutdown,
    Threads,
    WantWork,
    Work,
    WorkerSettings,
    WorkItem,
)
from modelpool.workers.capabilities.base import Answered, error_reply
from modelpool.workers.capabilities.text_to_text import GenerationStats, TextOutput, end_reply

IDLE_TRIM_S = 1.0  # idle this long after work: return freed memory to the OS


class Emitted(Protocol):
    """One step's outcome for one sequence (registry/loaders/batched_decode.Emitted)."""

    seq_id: int
    text: str
    logprob: TokenLogprob | None  # its token's, if the stream asks for logprobs
    stats: GenerationStats | None  # set when it ended (it has left the decoder)
    error: BaseException | None  # set when it failed (it has left the decoder)
    # Optional: tokens, how many tokens the piece is (0: text the decoder held, flushed
    # at its end); 1 without it.


class Decoder(Protocol):
    """What a model's `decoder()` returns: its sequences, stepped together."""

    default_max_sequences: int

    def __len__(self) -> int: ...

    def add(self, seq_id: int, prepared: Any) -> None:
        """A sequence joins at the next step (prepared: what the model's prepare made)."""

    def drop(self, seq_id: int) -> GenerationStats | None:
        """It leaves now; its stats so far (None if unknown)."""

    def step(self) -> list[Emitted]:
        """One forward pass over the sequences; what it did for each."""


class StreamWorker(Protocol):
    """The parts of workers.main.Worker this loop uses."""

    sock: Any
    stopping: bool
    image_bytes: dict[tuple[int, int], bytes]
    threads_wanted: int  # the supervisor's last grant; use_threads applies it

    def send(self, msg: Any) -> None: ...

    def receive(self) -> Work | Abort | Shutdown | Threads: ...

    def use_threads(self) -> None: ...

    def tick(self, tokens: int = 0) -> None: ...

    def take_images(self, items: list[WorkItem]) -> None: ...


Prepare = Callable[[WorkItem], Any]  # raises for bad input: that stream gets an Error


@dataclass
class Plan:
    decoder: Decoder
    slots: int  # sequences at most


def plan(model: Any, settings: WorkerSettings, capable: bool) -> Plan | None:
    """Continuous batching for this worker, or None: one request at a time as before
    (a capability or model that cannot, or max_active_sequences = 1)."""
    wanted = settings.spec.max_active_sequences
    if not capable or wanted == 1 or not hasattr(model, "decoder"):
        return None
    decoder = model.decoder()
    if decoder is None:
        return None
    slots = wanted or decoder.default_max_sequences
    return Plan(decoder, slots) if slots > 1 else None


@dataclass
class _Stream:
    output: TextOutput
    seq: int = 0  # the next chunk's number


@dataclass
class StreamLoop:
    decoder: Decoder
    prepare: Prepare
    worker: StreamWorker
    streams: dict[int, _Stream] = field(default_factory=dict)
    freed: int = 0  # slots freed since the last WantWork

    def run(self, slots: int, trim: Callable[[], None]) -> None:
        """Serve until told to stop; then end every stream still running."""
        self.worker.send(WantWork(slots=slots))
        trim_when_idle = False
        while not self.worker.stopping:
            if not self.streams and trim_when_idle and not _readable(self.worker, IDLE_TRIM_S):
                trim()
                trim_when_idle = False
            self._receive(block=not self.streams)
            if self.streams and not self.worker.stopping:
                self._step()
                trim_when_idle = True
            if self.freed and not self.worker.stopping:
                self.worker.send(WantWork(slots=self.freed))
                self.freed = 0
        for job_id in list(self.streams):
            self._cancel(job_id)

    def _receive(self, block: bool) -> None:
        """Everything the supervisor sent; waits for the first message only if block."""
        while block or _readable(self.worker, 0):
            block = False
            match self.worker.receive():
                case Work(items=items, threads=threads):
                    self.worker.threads_wanted = threads or self.worker.threads_wanted
                    self.worker.use_threads()  # before the new streams' prefill
                    self._start(items)
                case Threads(count=count):
                    self.worker.threads_wanted = count
                case Abort(job_id=job_id) if job_id in self.streams:
                    self._cancel(job_id)
                case Abort():
                    pass  # for a stream already ended: its End crossed the abort
                case Shutdown():
                    self.worker.stopping = True
        self.worker.use_threads()

    def _start(self, items: list[WorkItem]) -> None:
        self.worker.take_images(items)
        for item in items:
            try:
                prepared = self.prepare(item)
            except Exception as exc:
                prepared = Answered(error_reply(item.job_id, exc))
            if isinstance(prepared, Answered):  # no sequence: its reply now
                self.worker.send(prepared.reply)
                self.freed += 1
                continue
            self.decoder.add(item.job_id, prepared)
            self.streams[item.job_id] = _Stream(TextOutput(
                item.request.sampling, getattr(prepared, "tool_calls", None),
                getattr(prepared, "reasoning", None)))
        self.worker.image_bytes = {}

    def _step(self) -> None:
        try:
            events = self.decoder.step()
        except Exception as exc:  # a decoder bug: fail what runs, keep the worker
            for job_id in list(self.streams):
                self.decoder.drop(job_id)
                self._close(job_id, error_reply(job_id, exc))
            return
        self.worker.tick(sum(e.error is None for e in events))
        for event in events:
            self._emit(event)

    def _emit(self, event: Emitted) -> None:
        job_id = event.seq_id
        stream = self.streams[job_id]
        if event.error is not None:
            self._close(job_id, error_reply(job_id, event.error))
            return
        text, hit = stream.output.feed(event.text, getattr(event, "tokens", 1))
        stats = event.stats
        if hit and stats is None:
            stats = self.decoder.drop(job_id) or GenerationStats()
        calls: list[ToolCall] = []
        if stats is not None:
            tail, calls = stream.output.finish()
            text += tail
        chunk = stream.output.chunk(job_id, stream.seq, text,
                                    None if event.logprob is None else [event.logprob])
        if chunk is not None:
            self.worker.send(chunk)
            stream.seq += 1
        if stats is not None:
            reason = "stop" if hit else stats.finish_reason
            self._close(job_id, end_reply(job_id, stats, reason, calls, stream.output))

    def _cancel(self, job_id: int) -> None:
        stats = self.decoder.drop(job_id) or GenerationStats()
        self._close(job_id, End(id=job_id, finish_reason="cancelled",
                                prompt_tokens=stats.prompt_tokens,
                                completion_tokens=stats.completion_tokens))

    def _close(self, job_id: int, reply: Any) -> None:
        del self.streams[job_id]
        self.worker.send(reply)
        self.freed += 1


def _readable(worker: StreamWorker, timeout_s: float) -> bool:
    return bool(select.select([worker.sock], [], [], timeout_s)[0])
