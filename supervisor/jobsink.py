"""Where a submitted job's replies go in the pool: a MailboxSink stands for the client
connection a direct request would have, and gathers the replies into one result for the
mailbox. Closing the client connection that submitted the job does not touch it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from modelpool.protocol.jobs import Completion
from modelpool.protocol.kinds import FINAL
from modelpool.protocol.messages import (
    CallDelta,
    Chunk,
    End,
    Error,
    TokenLogprob,
)
from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.pgstreams import call_head, logprobs_text
from modelpool.supervisor.queueing import JobState

if TYPE_CHECKING:
    from modelpool.supervisor.jobservice import JobService


class _Requesters(dict[int, Any]):
    """The sink's requests in flight, as the pool's job book registers them; whether one
    ever was tells a refusal (answered before it) from a job's real end."""

    registered = False

    def __setitem__(self, key: int, value: Any) -> None:
        self.registered = True
        super().__setitem__(key, value)


class MailboxSink:
    """A submitted job's replies, gathered into one result: its `connection` in the pool.
    Closing the client connection that submitted the job does not touch it."""

    closed = False

    def __init__(self, service: JobService, record: JobRecord) -> None:
        self.service = service
        self.record = record
        self.owner = (record.uid, "jobs")  # its user's jobs take one turn among its clients
        self.jobs = _Requesters()
        self.lost = False  # its claim lapsed: another daemon's result counts, not ours
        self.refusal: Error | None = None  # the pool refused to queue it
        self._text: list[str] = []
        self._chars = 0  # of text so far
        self._reasoning: list[str] = []  # a reasoning model's thinking so far
        self._thought = 0  # its characters
        self._arguments: dict[int, int] = {}  # characters of each tool call's arguments
        self._logprobs: list[TokenLogprob] = []  # of its tokens so far, if asked for

    @property
    def running(self) -> bool:
        req = self.jobs.get(0)
        return req is not None and req.job is not None and req.job.state is JobState.RUNNING

    def _relay(self, text: str, reasoning: str, logprobs: list[TokenLogprob],
               calls: Iterable[CallDelta]) -> None:
        """A relayed stream's pieces, each part in the order the chunk holds it."""
        record = self.record
        if reasoning:
            self.service.stream_piece(record, "r", self._thought, reasoning)
        if text:
            self.service.stream_piece(record, "", self._chars, text)
        if logprobs:
            self.service.stream_piece(record, "l", len(self._logprobs), logprobs_text(logprobs))
        for call in calls:
            part = str(call.index)
            if call.name:
                self.service.stream_piece(record, "h" + part, 0, call_head(call))
            if call.arguments:
                done = self._arguments.get(call.index, 0)
                self.service.stream_piece(record, "c" + part, done, call.arguments)
                self._arguments[call.index] = done + len(call.arguments)

    def send(self, msg: Any) -> None:
        if self.lost:
            return
        match msg:
            case Chunk(text=text, reasoning=reasoning, logprobs=logprobs, calls=calls):
                if self.record.stream_to is not None:
                    self._relay(text, reasoning, logprobs or [], calls or ())
                self._reasoning.append(reasoning)
                self._thought += len(reasoning)
                self._text.append(text)
                self._chars += len(text)
                if logprobs is not None:
                    self._logprobs.extend(logprobs)
            case End():
                self.service.ended(self, Completion(
                    text="".join(self._text), finish_reason=msg.finish_reason,
                    prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
                    model=msg.model, logprobs=self._logprobs or None,
                    prompt_logprobs=msg.prompt_logprobs, tool_calls=msg.tool_calls,
                    cached_tokens=msg.cached_tokens, reasoning="".join(self._reasoning),
                    reasoning_tokens=msg.reasoning_tokens))
            case Error() if not self.jobs.registered:
                self.refusal = msg  # answered at once, never queued
            case _ if isinstance(msg, FINAL):  # any other kind's final reply: its result
                self.service.ended(self, msg)
            case _:
                pass  # image progress: the stored result is the finished image
