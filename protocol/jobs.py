"""The job API on the wire: hand the daemon a request, get a key at once, and retrieve
the result later, from any connection, until it expires.

    Submit(request)   -> JobKey(key)            the same admission errors as a direct call
    Follow(key)       -> Chunk*, End | Error     a generate or describe job's stream, from
                                                 its start, whatever connection asks
    Retrieve(key, timeout_s) -> JobResult | Error   waits up to timeout_s; TIMEOUT if not done
    JobQuery(key)     -> JobReply(JobInfo)      state and times
    CancelJob(key), ForgetJob(key) -> Ack
    ListJobs()        -> JobsReply              the caller's recent jobs
    GetStats()        -> StatsReply             the pool's figures

A key is unguessable and belongs to the user who submitted it: to anyone else it does
not exist (RESULT_NOT_FOUND).
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import msgspec

from modelpool.protocol.messages import (
    Detokenized,
    Embeddings,
    Image,
    Scores,
    Tokenized,
    TokenLogprob,
    ToolCall,
    WorkRequest,
)

JobState = Literal["queued", "running", "done", "failed", "cancelled"]
ENDED: frozenset[str] = frozenset({"done", "failed", "cancelled"})


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="op", omit_defaults=True):
    pass


class Submit(_Msg, frozen=True, kw_only=True, tag="submit"):
    id: int
    request: WorkRequest  # its own id is not used
    single: bool = False  # one input where a list was possible: the result is one row
    # a generate or describe job's chunks kept as it runs, for Follow to stream (without
    # it, Follow sends the result whole once the job ends)
    stream: bool = False


class Follow(_Msg, frozen=True, kw_only=True, tag="follow"):
    """A text job's stream, from its first chunk, live while it runs, then its End (or
    the Error it ended with), as a direct request's stream would have come; as often as
    asked, from any connection of its user."""

    id: int
    key: str


class JobKey(_Msg, frozen=True, kw_only=True, tag="job_key"):
    id: int
    key: str


class Retrieve(_Msg, frozen=True, kw_only=True, tag="retrieve"):
    id: int
    key: str
    timeout_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 30.0  # 0: do not wait


class Completion(_Msg, frozen=True, kw_only=True, tag="completion"):
    """A generate or describe job's result: the whole text at once."""

    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    logprobs: list[TokenLogprob] | None = None  # every output token's, if asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # every prompt token's, if asked for
    tool_calls: list[ToolCall] | None = None  # the calls it made (tool_choice "auto")
    cached_tokens: int = 0  # of prompt_tokens, taken from the worker's prefix cache
    reasoning: str = ""  # a reasoning model's thinking, apart from its answer (text)
    reasoning_tokens: int = 0  # of completion_tokens, the thinking's


# What a job ends with: its kind's final reply (a text job's whole, as a Completion)
JobOutcome = Embeddings | Scores | Completion | Image | Tokenized | Detokenized


class JobResult(_Msg, frozen=True, kw_only=True, tag="job_result"):
    id: int
    key: str
    result: JobOutcome  # its own id is not used
    single: bool = False


class JobInfo(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    op: str  # the request kind: "embed", "generate", ...
    model: str
    priority: str
    state: JobState
    submitted_at: float  # seconds since the epoch
    started_at: float | None = None
    finished_at: float | None = None
    error_code: str | None = None  # failed or cancelled: why
    error_message: str | None = None
    node: str = ""  # which daemon ran it


class JobQuery(_Msg, frozen=True, kw_only=True, tag="job"):
    id: int
    key: str


class JobReply(_Msg, frozen=True, kw_only=True, tag="job_reply"):
    id: int
    job: JobInfo


class CancelJob(_Msg, frozen=True, kw_only=True, tag="cancel_job"):
    id: int
    key: str


class ForgetJob(_Msg, frozen=True, kw_only=True, tag="forget_job"):
    id: int
    key: str


class ListJobs(_Msg, frozen=True, kw_only=True, tag="jobs"):
    id: int
    limit: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 100


class JobsReply(_Msg, frozen=True, kw_only=True, tag="jobs_reply"):
    id: int
    jobs: list[JobInfo]


class GetStats(_Msg, frozen=True, kw_only=True, tag="stats"):
    id: int


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    workers: int  # live worker processes, weights holders left out
    busy_workers: int
    active_jobs: int  # requests and jobs running on a worker now
    queued_jobs: int  # waiting for a worker
    memory_used_mb: float
    memory_budget_mb: float
    completed: int  # since the daemon started
    failed: int
    stored_results: int  # jobs whose result the mailbox holds
    mailbox_bytes: int
    nodes: int = 1  # daemons sharing a queue: the figures are their sums
    duplicate_results: int = 0  # a job run twice (a lapsed claim): the later result dropped


class StatsReply(_Msg, frozen=True, kw_only=True, tag="stats_reply"):
    id: int
    stats: PoolStats


JobRequest = (Submit | Follow | Retrieve | JobQuery | CancelJob | ForgetJob | ListJobs
              | GetStats)
JobResponse = JobKey | JobResult | JobReply | JobsReply | StatsReply
JOB_REQUESTS: tuple[type, ...] = typing.get_args(JobRequest)
