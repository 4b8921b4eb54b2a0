"""The Responses API's answers as /openapi.json describes them: a response, its output
items, and the events of a streamed one."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int  # input tokens whose keys and values the prefix cache held


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any]
    logprobs: list[dict[str, Any]]  # with include: ["message.output_text.logprobs"]


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputItem(msgspec.Struct, omit_defaults=True):
    """A reasoning model's thinking, the answer's message, or one of its function
    calls."""

    type: Literal["reasoning", "message", "function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] | None = None
    content: list[OutputText | ReasoningText] | None = None
    summary: list[Any] | None = None  # a reasoning item's: none is made
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None  # JSON text


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(msgspec.Struct):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, str] | None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, str | None] | None  # the effort asked for, if any
    store: bool  # kept: GET /v1/responses/{id} shows it, previous_response_id continues it
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[Any]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]
    background: bool  # run as a job, shown by GET /v1/responses/{id}


class ResponseDeleted(msgspec.Struct):
    id: str
    object: Literal["response"]
    deleted: bool


class ResponseItemList(msgspec.Struct):
    """A page of a kept response's input items, in OpenAI's cursor list."""

    object: Literal["list"]
    data: list[dict[str, Any]]  # messages, function calls and their outputs, each with an id
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseEvent(msgspec.Struct, omit_defaults=True):
    """One streamed event (its `event:` line names its type)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    logprobs: list[dict[str, Any]] | None = None
