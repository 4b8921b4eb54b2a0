"""text_to_text: a prompt in, a stream of text chunks out, one request at a time."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import (
    CallDelta,
    Chunk,
    End,
    Generate,
    Sampling,
    TokenLogprob,
    ToolCall,
)
from modelpool.protocol.pipes import WorkItem
from modelpool.workers.capabilities import text_limits, tokens
from modelpool.workers.capabilities.base import Answered, Outbox, error_reply


@dataclass
class GenerationStats:
    """Filled in by the model while it generates."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, taken from the prefix cache
    completion_tokens: int = 0
    finish_reason: str = "length"  # the model sets "stop" when it emits end-of-sequence
    # the last token's, when the request asks for logprobs: the adapter takes it
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # when the request asks for them

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The last token's entry for the next chunk, once (None: none)."""
        entry, self.logprob = self.logprob, None
        return None if entry is None else [entry]


class TextGenerationModel(Protocol):
    def generate(self, request: Generate, stats: GenerationStats) -> Iterator[str]:
        """Yield one text piece per generated token (possibly "", e.g. half a character),
        so the worker can mark progress and honour aborts at every step."""

    def info(self) -> dict[str, Any]:
        """Facts for the supervisor's status, e.g. {"context": 2048}."""


class StopMatcher:
    """Cuts the stream at the first stop string, holding back text that may start one;
    none is looked for in the first min_tokens pieces (one piece a token)."""

    def __init__(self, stops: list[str], min_tokens: int = 0) -> None:
        self.stops = [s for s in stops if s]
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.unstoppable = min_tokens  # pieces still to come that no stop string may end

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was hit."""
        self.pending += piece
        self.unstoppable -= 1
        hits = [] if self.unstoppable >= 0 else [
            i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.pending = self.pending[: min(hits)], ""
            return text, True
        cut = len(self.pending) - self.holdback
        if cut <= 0:
            return "", False
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


class ToolReader(Protocol):
    """Reads a model's tool calls out of its text (registry/loaders/tool_calls)."""

    def feed(self, text: str) -> str: ...

    def finish(self) -> tuple[str, list[ToolCall]]: ...

    # Optional: `take_deltas()`, the calls' pieces as they are written, and `cut`, True
    # when the calls are what was streamed of them, cut short (tool_stream.py).


class ReasoningSplitter(Protocol):
    """Reads a reasoning model's thinking out of its text (registry/loaders/reasoning)."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...

    # Optional: `thinking`, whether the text fed so far leaves it inside the thinking,
    # for usage's reasoning_tokens (0 without it).


class TextOutput:
    """What a stream's pieces become: text cut at the first stop string, a reasoning
    model's thinking read out of it, and, with tool_choice "auto", the model's calls
    read out of its answer."""

    def __init__(self, sampling: Sampling, calls: ToolReader | None = None,
                 reasoning: ReasoningSplitter | None = None) -> None:
        self.stop = StopMatcher(sampling.stop, sampling.min_tokens)
        self.calls = calls
        self.reasoning = reasoning
        self.thinking = ""  # thinking read since the last take_thinking
        # The reader's twin, fed each piece as it comes (the stop strings hold text back):
        # whether each token was thinking, its tags included
        self.counter = copy.deepcopy(reasoning) if hasattr(reasoning, "thinking") else None
        self.reasoning_tokens = 0

    def feed(self, piece: str, tokens: int = 1) -> tuple[str, bool]:
        """Answer text safe to emit now, and whether a stop string was hit; `tokens`:
        how many tokens the piece is (0: text the decoder held, flushed at the end)."""
        if self.counter is not None:
            was = self.counter.thinking
            self.counter.feed(piece)
            if was or self.counter.thinking:
                self.reasoning_tokens += tokens
        text, hit = self.stop.feed(piece)
        return self._answer(text), hit

    def _answer(self, text: str) -> str:
        if self.reasoning is not None:
            thinking, text = self.reasoning.feed(text)
            self.thinking += thinking
        return text if self.calls is None else self.calls.feed(text)

    def chunk(self, job_id: int, seq: int, text: str,
              logprobs: list[TokenLogprob] | None = None) -> Chunk | None:
        """The stream's next chunk: this answer text and logprobs with the thinking and
        the calls' pieces read since the last; None when it would carry nothing."""
        thinking, self.thinking = self.thinking, ""
        take = getattr(self.calls, "take_deltas", None)
        pieces: list[CallDelta] | None = (take() or None) if take is not None else None
        if not (text or thinking or logprobs or pieces):
            return None
        return Chunk(id=job_id, seq=seq, text=text, reasoning=thinking, logprobs=logprobs,
                     calls=pieces)

    @property
    def calls_cut(self) -> bool:
        """The calls are what was streamed of them, the output cut short in one."""
        return bool(getattr(self.calls, "cut", False))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the stream's end: the answer text still held back, and the calls made (the
        thinking still held is left for the last chunk)."""
        text = self._answer(self.stop.flush())
        if self.reasoning is not None:
            thinking, tail = self.reasoning.finish()
            self.thinking += thinking
            text += tail if self.calls is None else self.calls.feed(tail)
        if self.calls is None:
            return text, []
        rest, calls = self.calls.finish()
        return text + rest, calls


def end_reply(job_id: int, stats: GenerationStats, reason: str,
              calls: list[ToolCall], output: TextOutput) -> End:
    """A stream's End; one that made tool calls ends with "tool_calls", as OpenAI's
    (unless a call was cut short)."""
    made = calls and not output.calls_cut
    return End(id=job_id, finish_reason="tool_calls" if made else reason,
               prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
               completion_tokens=stats.completion_tokens,
               prompt_logprobs=stats.prompt_logprobs, tool_calls=calls or None,
               reasoning_tokens=min(output.reasoning_tokens, stats.completion_tokens))


def tool_reader(model: Any, request: Generate) -> ToolReader | None:
    """The reader of the model's calls when the request lets it make them."""
    read = getattr(model, "tool_reader", None)
    if read is not None:
        return read(request)  # type: ignore[no-any-return]
    if request.tool_choice == "auto":
        raise PoolError(ErrorCode.BAD_REQUEST, "tool_choice auto: this model's loader "
                                               "does not read tool calls")
    return None


def readers(model: Any, request: Generate) -> tuple[ToolReader | None,
                                                   ReasoningSplitter | None]:
    """What reads the model's calls and its thinking out of its text: its `readers`, or
    its `tool_reader` and (a reasoning model's) `reasoning_reader`."""
    both = getattr(model, "readers", None)
    if both is not None:
        return both(request)  # type: ignore[no-any-return]
    think = getattr(model, "reasoning_reader", None)
    return tool_reader(model, request), None if think is None else think(request)


def run(model: TextGenerationModel, items: list[WorkItem], out: Outbox, max_batch: int) -> None:
    for item in items:  # the supervisor sends one item at a time for streaming capabilities
        _run_one(model, item, out)


def _check(model: TextGenerationModel, item: WorkItem) -> Generate:
    request = item.request
    assert isinstance(request, Generate)
    text_limits.check_chat(model, request.prompt, request.messages)
    return request


def prepare(model: Any, item: WorkItem, out: Outbox) -> Any:
    """The item as a sequence for the model's continuous decoder (workers/streams.py), or
    its reply if it needs none (tokenize); raises PoolError for a prompt too long."""
    if isinstance(item.request, tokens.REQUESTS):
        return Answered(tokens.answer(model, item.job_id, item.request))
    return model.prepare(_check(model, item))


def _run_one(model: TextGenerationModel, item: WorkItem, out: Outbox) -> None:
    if isinstance(item.request, tokens.REQUESTS):
        try:
            out.send(tokens.answer(model, item.job_id, item.request))
        except Exception as exc:  # the worker lives on
            out.send(error_reply(item.job_id, exc))
        return
    try:
        request = _check(model, item)
        output = TextOutput(request.sampling, *readers(model, request))
    except PoolError as exc:
        out.send(error_reply(item.job_id, exc))
        return
    stats = GenerationStats()
    stream_text(item.job_id, lambda: model.generate(request, stats), stats, output, out)


def stream_text(job_id: int, start: Callable[[], Iterator[str]], stats: GenerationStats,
                output: TextOutput, out: Outbox) -> None:
    """Run a token stream to its end, a stop string or an abort: Chunks, then one End
    (or one Error if the model fails)."""
    seq = 0
    calls: list[ToolCall] = []
    made = 0  # tokens, as the model counts them: its last piece may be held text alone
    try:
        for piece in start():
            out.tick(1)
            if out.aborted(job_id):
                stats.finish_reason = "cancelled"
                break
            text, hit = output.feed(piece, stats.completion_tokens - made)
            made = stats.completion_tokens
            chunk = output.chunk(job_id, seq, text, stats.take_logprobs())
            if chunk is not None:
                out.send(chunk)
                seq += 1
            if hit:
                stats.finish_reason = "stop"
                break
        if stats.finish_reason != "cancelled":
            text, calls = output.finish()
            if (chunk := output.chunk(job_id, seq, text)) is not None:
                out.send(chunk)
    except Exception as exc:
        out.send(error_reply(job_id, exc))
        return
    out.send(end_reply(job_id, stats, stats.finish_reason, calls, output))
