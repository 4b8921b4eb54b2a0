"""What the HTTP API answers: OpenAI's response shapes (and our extensions') built from
what the pool returned, and errors in OpenAI's JSON error shape with their status."""

from __future__ import annotations

import base64
import math
import time
import uuid
from typing import Any

import msgspec
import numpy as np
from starlette.responses import Response

from modelpool.protocol.client_core import ImageChunk, TextChunk, TextResult
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.httpapi import logprobs
from modelpool.supervisor.httpapi.tools import ToolCalls, openai_calls

# The status of each error code. 429s and 503s carry Retry-After.
STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400, ErrorCode.WRONG_CAPABILITY: 400,
    ErrorCode.IMAGE_TOO_LARGE: 400, ErrorCode.URL_NOT_ALLOWED: 400,
    ErrorCode.PROTOCOL_VERSION: 400,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.UNKNOWN_MODEL: 404, ErrorCode.RESULT_NOT_FOUND: 404,
    ErrorCode.CANCELLED: 409,
    ErrorCode.QUEUE_FULL: 429, ErrorCode.OVERLOADED: 429,
    ErrorCode.MODEL_ERROR: 500, ErrorCode.WORKER_DIED: 500, ErrorCode.INTERNAL: 500,
    ErrorCode.INSUFFICIENT_MEMORY: 503, ErrorCode.UNAVAILABLE: 503,
    ErrorCode.SHUTTING_DOWN: 503, ErrorCode.MODEL_LOAD_FAILED: 503,
    ErrorCode.TIMEOUT: 504, ErrorCode.DEADLINE_EXPIRED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
              403: "permission_error", 404: "not_found_error", 409: "conflict_error",
              408: "invalid_request_error", 413: "invalid_request_error",
              431: "invalid_request_error", 429: "rate_limit_error"}


class HttpError(Exception):
    """An error answered before the pool is asked (auth, body size, JSON)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(data), status, headers, "application/json")


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    kind = ERROR_TYPE.get(status, "server_error" if status < 503 else "service_unavailable")
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": param,
                                          "code": code}})


def pool_error(exc: PoolError) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers for an error of the pool."""
    status = STATUS.get(exc.code, 500)
    headers = {}
    if status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s or 1)))
    param = exc.message.split(":", 1)[0] if exc.code is ErrorCode.BAD_REQUEST else None
    if param is not None and (" " in param or len(param) > 64):
        param = None  # a sentence, not a field name
    return status, error_body(status, exc.message, exc.code.value.lower(), param), headers


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def vector(row: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode()
    return row.tolist()


def rows(reply: Any) -> np.ndarray:
    """An Embeddings reply's vectors, one row per input."""
    array = np.frombuffer(reply.data, dtype=np.dtype(reply.dtype).newbyteorder("<"))
    return array.reshape(reply.shape)


def embeddings(rows: np.ndarray, model: str, encoding: str, tokens: int = 0) -> dict[str, Any]:
    """Usage counts the input tokens the model read (0 for images, and for a model that
    cannot say)."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": vector(row, encoding)}
                     for i, row in enumerate(rows)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank(scores: np.ndarray, documents: list[str], model: str, top_n: int | None,
           with_documents: bool) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if with_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": new_id("rerank"), "model": model, "results": results}


def usage(prompt_tokens: int | None, completion_tokens: int | None,
          cached_tokens: int | None = 0, reasoning_tokens: int | None = 0) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: of the prompt's, those the prefix cache held;
    `reasoning_tokens`: of the completion's, a reasoning model's thinking."""
    p, c = prompt_tokens or 0, completion_tokens or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached_tokens or 0},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens or 0}}


def completion(texts: list[TextResult], chat: bool, model: str,
               echo: list[str | list[int]] | None = None, n: int = 1,
               calls: ToolCalls | None = None) -> dict[str, Any]:
    """Whole generations, one a choice, as chat.completion (its text as tool calls when
    `calls` says how) or text_completion, `n` choices a prompt (choice i is prompt
    i // n's; after its prompt when they are echoed, the prompt's tokens first in the
    logprobs; a prompt of token ids as their text); each prompt counted once, as OpenAI
    does."""
    choices = []
    for index, text in enumerate(texts):
        finish = _finish(text.finish_reason)
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        if chat and calls is not None:
            choice.update(message=calls.message(text.text, text.tool_calls),
                          finish_reason=calls.finish(finish),
                          logprobs=logprobs.chat(text.logprobs))
        elif chat:
            choice.update(message={"role": "assistant", "content": text.text},
                          logprobs=logprobs.chat(text.logprobs))
        if chat and text.reasoning:
            choice["message"]["reasoning_content"] = text.reasoning
        if not chat:
            choice.update(_completion_text(text, None if echo is None else echo[index // n]))
        choices.append(choice)
    prompt_tokens = sum(t.prompt_tokens for t in texts[::n])
    cached_tokens = sum(t.cached_tokens for t in texts[::n])
    return {"id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": texts[0].model or model,
            "choices": choices, "usage": usage(prompt_tokens,
                                               sum(t.completion_tokens for t in texts),
                                               cached_tokens,
                                               sum(t.reasoning_tokens for t in texts))}


def _completion_text(text: TextResult, echo: str | list[int] | None) -> dict[str, Any]:
    entries = text.logprobs
    if echo is not None and text.prompt_logprobs is not None:
        entries = [*text.prompt_logprobs, *(text.logprobs or [])]
    prefix = echo if isinstance(echo, str) or echo is None else "".join(
        e.token for e in text.prompt_logprobs or [])
    return {"text": (prefix or "") + text.text, "logprobs": logprobs.completion(entries)[0]}


def _finish(reason: str | None) -> str | None:
    # OpenAI's reasons are stop, length and tool_calls; a cancelled generation has ended
    # by a stop.
    if reason is None or reason in ("length", "tool_calls"):
        return reason
    return "stop"


class StreamShape:
    """The chunks of one streamed completion's choices, as server-sent events (a
    completion's echoed prompt first in its choice's first); with include_usage, the
    usage of them all once the last has ended."""

    def __init__(self, chat: bool, model: str, include_usage: bool, choices: int = 1,
                 n: int = 1, calls: ToolCalls | None = None,
                 echo: list[str | list[int]] | None = None) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.calls = calls  # a chat's text made tool calls
        self.echo = echo  # a completion's prompts (texts: echo is not streamed with logprobs)
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.started: set[int] = set()  # choices that have sent their first chunk
        self.running, self.n = choices, n  # choice i is prompt i // n's
        self.prompt_tokens: dict[int, int] = {}  # by prompt
        self.cached_tokens: dict[int, int] = {}  # by prompt
        self.completion_tokens = self.reasoning_tokens = 0
        self.offsets: dict[int, int] = {}  # by choice: its tokens' text so far, in chars

    def event(self, chunk: TextChunk, index: int = 0) -> bytes:
        finish = _finish(chunk.finish_reason)
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        if self.chat and self.calls is not None:
            made = self.calls.delta(index, chunk, index not in self.started)
            if made is None:  # a list of calls, held until whole
                return b""
            choice.update(delta=made[0], logprobs=logprobs.chat(made[1]),
                          finish_reason=self.calls.finish(finish))
        elif self.chat:
            choice["delta"] = {"content": chunk.text} if index in self.started else {
                "role": "assistant", "content": chunk.text}
            choice["logprobs"] = logprobs.chat(chunk.logprobs)
        if self.chat and chunk.reasoning:  # vLLM's field
            choice["delta"] = _thinking_first(choice["delta"], chunk.reasoning)
        if not self.chat:
            listed, self.offsets[index] = logprobs.completion(chunk.logprobs,
                                                              self.offsets.get(index, 0))
            text = chunk.text
            if self.echo is not None and index not in self.started:
                text = f"{self.echo[index // self.n]}{text}"  # the prompt, in the first
            choice.update(text=text, logprobs=listed)
        self.started.add(index)
        out = sse(self._wrap([choice], None))
        if chunk.finish_reason is not None:
            self.running -= 1
            self.prompt_tokens[index // self.n] = chunk.prompt_tokens or 0
            self.cached_tokens[index // self.n] = chunk.cached_tokens or 0
            self.completion_tokens += chunk.completion_tokens or 0
            self.reasoning_tokens += chunk.reasoning_tokens or 0
            if self.running == 0 and self.include_usage:
                out += sse(self._wrap([], usage(sum(self.prompt_tokens.values()),
                                                self.completion_tokens,
                                                sum(self.cached_tokens.values()),
                                                self.reasoning_tokens)))
        return out

    def _wrap(self, choices: list[dict[str, Any]], use: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": use}


def _thinking_first(delta: dict[str, Any], thinking: str) -> dict[str, Any]:
    """A delta with the thinking made since the last; its content left out while it has
    none (a client that joins the contents then sees the answer's alone)."""
    return {**{k: v for k, v in delta.items() if k != "content" or v},
            "reasoning_content": thinking}


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def image(chunk: ImageChunk) -> dict[str, Any]:
    assert chunk.png is not None
    return {"created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(chunk.png).decode()}]}


def job_result(op: str, result: Any) -> dict[str, Any]:
    """A finished job's result, by what its operation returns."""
    if isinstance(result, TextResult):
        return {"text": result.text, "reasoning": result.reasoning or None,
                "finish_reason": _finish(result.finish_reason),
                "tool_calls": openai_calls(result.tool_calls) if result.tool_calls else None,
                "model": result.model, "logprobs": logprobs.chat(result.logprobs),
                "prompt_logprobs": logprobs.chat(result.prompt_logprobs),
                "usage": usage(result.prompt_tokens, result.completion_tokens,
                               result.cached_tokens, result.reasoning_tokens)}
    if isinstance(result, ImageChunk):
        assert result.png is not None
        return {"b64_json": base64.b64encode(result.png).decode(), "width": result.width,
                "height": result.height, "seed": result.seed}
    if op == "rerank":
        return {"scores": [float(s) for s in result]}
    rows = np.atleast_2d(result)
    return {"data": [{"index": i, "embedding": row.tolist()} for i, row in enumerate(rows)]}
