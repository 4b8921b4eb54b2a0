"""GET /openapi.json: the API described from the same Structs that decode its bodies,
and the shapes of its answers."""

from __future__ import annotations

import functools
from typing import Any, Literal

import msgspec

from modelpool.supervisor.httpapi import bodies, tokenizing
from modelpool.supervisor.httpapi.responses_in import ResponsesBody
from modelpool.supervisor.httpapi.responses_schema import (
    ResponseDeleted,
    ResponseEvent,
    ResponseItemList,
    ResponseObject,
)


class ErrorObject(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(msgspec.Struct):
    error: ErrorObject


class EmbeddingObject(msgspec.Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct):
    object: Literal["list"]
    model: str
    data: list[EmbeddingObject]
    usage: EmbeddingUsage


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens whose keys and values the prefix cache held


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int  # of completion_tokens, a reasoning model's thinking


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # None: tool calls only
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (as vLLM's)


class StreamedCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None  # the first delta of a call
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None  # name (first), arguments (as they come)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None


class TextLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]  # the chosen token's too
    text_offset: list[int]


class ChatChoice(msgspec.Struct):
    index: int
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    message: AssistantMessage
    logprobs: ChatLogprobs | None  # with logprobs: true


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(msgspec.Struct):
    index: int
    finish_reason: Literal["stop", "length"] | None
    text: str
    logprobs: TextLogprobs | None  # with logprobs: N


class TextCompletion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class Delta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking
    content: str | None = None
    tool_calls: list[StreamedCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    delta: Delta
    logprobs: ChatLogprobs | None  # this chunk's tokens', with logprobs: true


class ChatChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None  # set on the last event, with stream_options.include_usage


class TextChunk(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    capability: str
    state: str
    # vLLM's name: the tokens it sees (prompt and output), once one of its workers loaded it
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class ImageData(msgspec.Struct):
    b64_json: str


class ImagesResponse(msgspec.Struct):
    created: int
    data: list[ImageData]


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]


class JobCreated(msgspec.Struct):
    id: str
    object: Literal["job"]
    operation: str
    status: Literal["queued"]


class JobError(msgspec.Struct):
    code: str
    message: str


class Job(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["job"]
    operation: str
    model: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: JobError | None = None
    result: dict[str, Any] | None = None  # by operation: data, text, scores or b64_json


class Health(msgspec.Struct):
    status: str


# path, method, summary, request body, response, its events when streamed
_OPERATIONS: list[tuple[str, str, str, type | None, type | None, type | None]] = [
    ("/v1/embeddings", "post", "Text embeddings", bodies.EmbeddingsBody,
     EmbeddingsResponse, None),
    ("/v1/chat/completions", "post", "Chat (and vision: image_url parts)", bodies.ChatBody,
     ChatCompletion, ChatChunk),
    ("/v1/completions", "post", "Text completion of a raw prompt", bodies.CompletionBody,
     TextCompletion, TextChunk),
    ("/v1/responses", "post", "OpenAI's Responses API (a chat; background: a job)",
     ResponsesBody, ResponseObject, ResponseEvent),
    ("/v1/responses/{id}", "get", "A kept response; a background one with its output once "
     "done, or (stream) its events", None, ResponseObject, ResponseEvent),
    ("/v1/responses/{id}/cancel", "post", "Cancel a background response", None,
     ResponseObject, None),
    ("/v1/responses/{id}", "delete", "Remove a kept response (a background one cancelled)",
     None, ResponseDeleted, None),
    ("/v1/responses/{id}/input_items", "get", "A page of a kept response's input items",
     None, ResponseItemList, None),
    ("/v1/images/generations", "post", "Text to image", bodies.ImagesBody, ImagesResponse,
     None),
    ("/v1/models", "get", "Models the daemon knows", None, ModelList, None),
    ("/v1/models/{model}", "get", "One model, by its key or an alias", None, ModelCard, None),
    ("/v1/image_embeddings", "post", "Image embeddings (extension)",
     bodies.ImageEmbeddingsBody, EmbeddingsResponse, None),
    ("/v1/rerank", "post", "Relevance of documents to a query (extension)",
     bodies.RerankBody, RerankResponse, None),
    ("/tokenize", "post", "A prompt's or a chat's token ids, as the model reads them (vLLM's)",
     tokenizing.TokenizeBody, tokenizing.TokenIdsAnswer, None),
    ("/detokenize", "post", "Token ids into text (vLLM's)", tokenizing.DetokenizeBody,
     tokenizing.TextAnswer, None),
    ("/v1/jobs", "post", "Run a body of another endpoint as a job", bodies.JobBody,
     JobCreated, None),
    ("/v1/jobs/{key}", "get", "A job, with its result once done", None, Job, None),
    ("/v1/jobs/{key}", "delete", "Cancel a job", None, Job, None),
    ("/health", "get", "Liveness", None, Health, None),
    ("/ready", "get", "Readiness: the daemon accepts work", None, Health, None),
]


def _events(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """Each server-sent event: a chunk (or an error that ended the stream), then
    `[DONE]`."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [chunk, error]}}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "properties": {"data": {
            "if": {"const": "[DONE]"}, "then": True, "else": json_data}}}}}


@functools.cache
def openapi_document() -> bytes:
    types = [t for op in _OPERATIONS for t in op[3:] if t is not None]
    schemas, components = msgspec.json.schema_components(
        [*types, ErrorResponse], ref_template="#/components/schemas/{name}")
    schema_of = dict(zip([*types, ErrorResponse], schemas, strict=True))
    error = schema_of[ErrorResponse]
    paths: dict[str, dict[str, Any]] = {}
    for path, method, summary, request, response, chunk in _OPERATIONS:
        content = {"application/json": {"schema": schema_of[response]}}
        if chunk is not None:
            content.update(_events(schema_of[chunk], error))
        operation: dict[str, Any] = {"summary": summary, "responses": {
            "202" if path == "/v1/jobs" else "200": {"description": "OK", "content": content},
            "default": {"description": "An error, in OpenAI's shape",
                        "content": {"application/json": {"schema": error}}}}}
        if path in ("/health", "/ready"):
            operation["security"] = []
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": schema_of[request]}}}
        if "{key}" in path:
            operation["parameters"] = _job_parameters(method)
        for name in ("model", "id"):
            if "{" + name + "}" in path:
                operation["parameters"] = [{"name": name, "in": "path", "required": True,
                                            "schema": {"type": "string"}}]
        if path.endswith("/input_items"):
            operation["parameters"].extend(_LIST_PARAMETERS)
        if path == "/v1/responses/{id}" and method == "get":
            operation["parameters"].extend(_STREAM_PARAMETERS)
        paths.setdefault(path, {})[method] = operation
    return msgspec.json.encode({
        "openapi": "3.1.0",
        "info": {"title": "modelpool", "version": "1",
                 "description": "OpenAI-compatible API of a modelpool daemon"},
        "components": {"schemas": components, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths})


_LIST_PARAMETERS: list[dict[str, Any]] = [
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "order", "in": "query", "required": False,
     "schema": {"type": "string", "enum": ["asc", "desc"]}},
    {"name": "include", "in": "query", "required": False, "explode": True,
     "schema": {"type": "array", "items": {"type": "string",
                                           "enum": ["message.input_image.image_url"]}}},
]


_STREAM_PARAMETERS: list[dict[str, Any]] = [
    {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
    {"name": "starting_after", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 0}},
]


def _job_parameters(method: str) -> list[dict[str, Any]]:
    parameters: list[dict[str, Any]] = [{"name": "key", "in": "path", "required": True,
                                         "schema": {"type": "string"}}]
    if method == "get":
        parameters.append({"name": "wait", "in": "query", "required": False,
                           "schema": {"type": "number", "minimum": 0, "maximum": 600}})
    return parameters
