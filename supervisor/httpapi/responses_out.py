"""What the Responses API answers: a `response` whose output items are a reasoning
model's thinking, then the chat answer's message and function calls, whole, or streamed
as OpenAI's typed events (created, each item added, its text or arguments in deltas,
done, then completed or incomplete), which the SDK's `responses.stream` checks item by
item."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from modelpool.protocol.client_core import TextChunk, TextResult
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import CallDelta, TokenLogprob, new_call_id
from modelpool.supervisor.httpapi import logprobs
from modelpool.supervisor.httpapi.choices import whole_text
from modelpool.supervisor.httpapi.responses_in import ResponsesBody
from modelpool.supervisor.httpapi.tools import ToolCalls

RESPONSE_ID = "resp_"
# an output item's id: the prefix, its response's hex
MESSAGE_ITEM, CALL_ITEM, REASONING_ITEM = "msg_", "fc_", "rs_"


def item_response_id(item_id: str) -> str | None:
    """The id of the response whose output item this is (msg_HEX, rs_HEX or
    fc_HEX_INDEX name resp_HEX), or None."""
    if item_id.startswith((MESSAGE_ITEM, REASONING_ITEM)):
        hex_ = item_id.partition("_")[2]
    elif item_id.startswith(CALL_ITEM):
        hex_ = item_id.removeprefix(CALL_ITEM).rpartition("_")[0]
    else:
        return None
    return f"{RESPONSE_ID}{hex_}" if hex_ else None


class ResponseShape:
    """One answer's response object and its items' ids, the same whole or streamed."""

    def __init__(self, body: ResponsesBody, model: str, calls: ToolCalls | None,
                 job_key: str = "", created: float | None = None, stored: bool = False) -> None:
        self.body, self.model, self.calls = body, model, calls
        self.hex = job_key or uuid.uuid4().hex  # a background response's: its job's
        self.id = f"{RESPONSE_ID}{self.hex}"
        self.created = int(time.time() if created is None else created)
        self.named_call_id = new_call_id()  # a named function's call, announced streamed
        self.stored = stored  # kept, for GET /v1/responses/{id} and previous_response_id
        # Given the finished response (completed or incomplete), whole or streamed
        self.on_finished: Callable[[dict[str, Any]], None] | None = None

    @property
    def streams_text(self) -> bool:
        """Its text goes out as it comes: free text, or an "auto" answer's (its calls
        stream apart); not a forced call's arguments."""
        return self.calls is None or self.calls.auto

    def message_id(self) -> str:
        return f"{MESSAGE_ITEM}{self.hex}"

    def call_item_id(self, index: int) -> str:
        return f"{CALL_ITEM}{self.hex}_{index}"

    def reasoning_id(self) -> str:
        return f"{REASONING_ITEM}{self.hex}"

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        """A reasoning model's thinking, whole, as OpenAI's open-weight models' (no
        summary: none is made)."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id(), "summary": [],
                "content": content, "status": status}

    def items(self, result: TextResult) -> list[dict[str, Any]]:
        """The answer's output items: its thinking (a reasoning model's), its message
        (unless it is only calls), then each function call."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        message = (self.calls.message(result.text, result.tool_calls) if self.calls
                   else {"content": result.text})
        calls = message.get("tool_calls") or []
        out = [self.reasoning_item(result.reasoning, "completed" if result.text or calls
                                   else status)] if result.reasoning else []
        if message["content"] is not None and (message["content"] or not calls):
            out.append(self.message_item(message["content"], status, result.logprobs))
        named = self.calls is not None and self.calls.named is not None
        for call in calls:
            out.append(self.call_item(len(out), call["function"]["name"],
                                      call["function"]["arguments"], status,
                                      self.named_call_id if named else call["id"]))
        return out

    def message_item(self, text: str, status: str,
                     entries: list[TokenLogprob] | None = None) -> dict[str, Any]:
        content = [] if status == "in_progress" else [_output_text(text, entries)]
        return {"type": "message", "id": self.message_id(), "status": status,
                "role": "assistant", "content": content}

    def call_item(self, index: int, name: str, arguments: str, status: str,
                  call_id: str) -> dict[str, Any]:
        return {"type": "function_call", "id": self.call_item_id(index), "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        form = body.text.format if body.text and body.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort, "summary": None}
            if body.reasoning else None,
            "store": self.stored,
            "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": msgspec.to_builtins(form) if form else {"type": "text"}},
            "tool_choice": msgspec.to_builtins(body.tool_choice or "auto"),
            "tools": msgspec.to_builtins(body.tools or []), "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
            "background": bool(body.background)}

    def whole(self, result: TextResult) -> dict[str, Any]:
        return self.finished(result, self.items(result))

    def finished(self, result: TextResult, items: list[dict[str, Any]]) -> dict[str, Any]:
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = self.response(status, items, usage(result))
        if self.on_finished is not None:
            self.on_finished(response)
        return response


# A background response's status, by its job's state (a done job's is its answer's)
STATUS_OF_JOB = {"queued": "queued", "running": "in_progress", "failed": "failed",
                 "cancelled": "cancelled"}


def background_shape(info: dict[str, Any], body: ResponsesBody | None,
                     calls: ToolCalls | None, stored: bool) -> ResponseShape:
    """A background response's shape, made alike wherever it is shown or streamed
    from: its job's (`info`), echoing its request's options (`body`, if known)."""
    return ResponseShape(body or ResponsesBody(input="", background=True), info["model"],
                         calls, info["key"], info["submitted_at"], stored=stored)


def background(info: dict[str, Any], result: TextResult | None,
               body: ResponsesBody | None = None) -> dict[str, Any]:
    """A background response as its job stands (`info`), with its answer once done,
    echoing its request's options if it was kept (`body`)."""
    shape = background_shape(info, body, ToolCalls(None, auto=True), body is not None)
    if result is not None:
        return shape.whole(result)
    error = None
    if info["state"] == "failed":
        error = {"code": info["error_code"].lower(), "message": info.get("error_message") or ""}
    return shape.response(STATUS_OF_JOB.get(info["state"], "in_progress"), [], error=error)


def usage(result: TextResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _output_text(text: str, entries: list[TokenLogprob] | None) -> dict[str, Any]:
    listed = logprobs.chat(entries)
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": listed["content"] if listed else []}


class ResponseStream:
    """One streamed answer's events, numbered in order. A reasoning model's thinking
    streams first, as item 0; its answer's items follow it."""

    def __init__(self, shape: ResponseShape, starting_after: int = -1) -> None:
        self.shape = shape
        self.sequence = 0
        self.starting_after = starting_after  # the events up to it are made, not sent
        self.parts: list[str] = []
        self.thinking: list[str] = []
        self.entries: list[TokenLogprob] = []
        self.opened = False  # the answer's first item (its message, a named call) announced
        self.thought = False  # the thinking's item is done
        self.call_at: dict[int, int] = {}  # an "auto" answer's calls streamed: output index
        self.closed: set[int] = set()  # items done before the end (a message before calls)

    @property
    def first(self) -> int:
        """The answer's first item's output index: after the thinking's, if any."""
        return 1 if self.thinking else 0

    def event(self, kind: str, **fields: Any) -> bytes:
        sequence = self.sequence
        self.sequence += 1
        if sequence <= self.starting_after:
            return b""
        data = msgspec.json.encode({"type": kind, "sequence_number": sequence, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self) -> bytes:
        snapshot = self.shape.response("in_progress", [])
        return (self.event("response.created", response=snapshot)
                + self.event("response.in_progress", response=snapshot))

    def queued(self) -> bytes:
        """A background response's first events, sent at once (its job may wait)."""
        snapshot = self.shape.response("queued", [])
        return (self.event("response.created", response=snapshot)
                + self.event("response.queued", response=snapshot))

    def chunk(self, chunk: TextChunk) -> bytes:
        self.parts.append(chunk.text)
        self.entries.extend(chunk.logprobs or ())
        out = self._think(chunk.reasoning) if chunk.reasoning else b""
        if chunk.text or chunk.calls or chunk.finish_reason is not None:
            cut = chunk.finish_reason == "length" and not any(self.parts) and not self.call_at
            out += self._thought("incomplete" if cut else "completed")
        if self.shape.streams_text and chunk.text:
            out += self._open_message()
            out += self.event("response.output_text.delta", item_id=self.shape.message_id(),
                              output_index=self.first, content_index=0, delta=chunk.text,
                              logprobs=(logprobs.chat(chunk.logprobs) or {}).get("content", []))
        elif self.shape.calls is not None and self.shape.calls.named is not None \
                and (chunk.text or chunk.finish_reason is not None):  # not while it thinks
            out += self._open_call()
            if chunk.text:
                out += self.event("response.function_call_arguments.delta",
                                  item_id=self.shape.call_item_id(self.first),
                                  output_index=self.first,
                                  delta=chunk.text)
        calls = self.shape.calls
        if chunk.calls and calls is not None and calls.auto:
            out += self._stream_calls(chunk.calls)
        elif calls is not None and not calls.auto and calls.named is None:  # "required"
            out += self._stream_calls(calls.list_pieces(0, chunk))
        if chunk.finish_reason is not None:
            out += self._end(whole_text(self.parts, self.entries, chunk, self.shape.model,
                                        self.thinking))
        return out

    def _think(self, text: str) -> bytes:
        """The thinking's delta, its item announced first."""
        out = b""
        if not self.thinking:
            out += self.event("response.output_item.added", output_index=0,
                              item=self.shape.reasoning_item("", "in_progress"))
        self.thinking.append(text)
        return out + self.event("response.reasoning_text.delta", item_id=self.shape.reasoning_id(),
                                output_index=0, content_index=0, delta=text)

    def _thought(self, status: str) -> bytes:
        """The thinking's item done, once the answer begins (or the output ends)."""
        if not self.thinking or self.thought:
            return b""
        self.thought = True
        text = "".join(self.thinking)
        item_id = self.shape.reasoning_id()
        return (self.event("response.reasoning_text.done", item_id=item_id, output_index=0,
                           content_index=0, text=text)
                + self.event("response.output_item.done", output_index=0,
                             item=self.shape.reasoning_item(text, status)))

    def failed(self, exc: PoolError) -> bytes:
        status = "cancelled" if exc.code is ErrorCode.CANCELLED else "failed"
        return self.event("response.failed", response=self.shape.response(
            status, [], error={"code": exc.code.value.lower(), "message": exc.message}))

    def _open_message(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        return self._message_added()

    def _message_added(self) -> bytes:
        message_id = self.shape.message_id()
        return (self.event("response.output_item.added", output_index=self.first,
                           item=self.shape.message_item("", "in_progress"))
                + self.event("response.content_part.added", item_id=message_id,
                             output_index=self.first, content_index=0,
                             part=_output_text("", None)))

    def _stream_calls(self, pieces: list[CallDelta]) -> bytes:
        """An "auto" answer's calls as the model writes them: each call's item announced
        (the message before it done first), then its arguments' pieces."""
        assert self.shape.calls is not None
        out = b""
        for piece in pieces:
            if piece.index > 0 and not self.shape.calls.parallel:
                continue
            if piece.index not in self.call_at:
                out += self._close_message()
                at = self.call_at[piece.index] = self.first + self.opened + piece.index
                out += self.event("response.output_item.added", output_index=at,
                                  item=self.shape.call_item(at, piece.name, "", "in_progress",
                                                            piece.id))
            if piece.arguments:
                at = self.call_at[piece.index]
                out += self.event("response.function_call_arguments.delta",
                                  item_id=self.shape.call_item_id(at), output_index=at,
                                  delta=piece.arguments)
        return out

    def _close_message(self) -> bytes:
        """The message done as the calls after it begin."""
        if not self.opened or self.first in self.closed:
            return b""
        self.closed.add(self.first)
        item = self.shape.message_item("".join(self.parts), "completed", self.entries or None)
        return self._item_done(self.first, item, announced=True)

    def _open_call(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        assert self.shape.calls is not None and self.shape.calls.named is not None
        return self.event("response.output_item.added", output_index=self.first,
                          item=self.shape.call_item(self.first, self.shape.calls.named, "",
                                                    "in_progress", self.shape.named_call_id))

    def _end(self, result: TextResult) -> bytes:
        """Each item done (those not streamed announced first), then the response."""
        items = self.shape.items(result)
        out = b""
        for index, item in enumerate(items):
            if item["type"] == "reasoning" or index in self.closed:
                continue  # streamed, and done as the answer (or a call) began
            announced = (index == self.first and self.opened) or index in self.call_at.values()
            out += self._item_done(index, item, announced)
        response = self.shape.finished(result, items)
        return out + self.event(f"response.{response['status']}", response=response)

    def _item_done(self, index: int, item: dict[str, Any], announced: bool) -> bytes:
        out = b""
        if item["type"] == "message":
            part = item["content"][0]
            if not announced:
                out += self._message_added()
                if part["text"]:
                    out += self.event("response.output_text.delta", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      delta=part["text"], logprobs=part["logprobs"])
            out += self.event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"],
                              logprobs=part["logprobs"])
            out += self.event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=part)
        else:
            if not announced:
                out += self.event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"})
                out += self.event("response.function_call_arguments.delta",
                                  item_id=item["id"], output_index=index,
                                  delta=item["arguments"])
            out += self.event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"])
        return out + self.event("response.output_item.done", output_index=index, item=item)


async def events(shape: ResponseShape, chunks: AsyncIterator[tuple[int, Any]],
                 queued: bool = False, starting_after: int = -1) -> AsyncIterator[bytes]:
    """The stream's events; an error of the pool mid-stream ends it as response.failed.
    The first chunk is in hand when the stream starts (its status depends on it): the
    opening events go out with its own, in one write, not two. A background response's
    (`queued`) say at once that it is queued. The same chunks make the same events:
    those up to `starting_after` are left out (a stream taken up again)."""
    stream = ResponseStream(shape, starting_after)
    if queued:
        if said := stream.queued():
            yield said
        opening = stream.event("response.in_progress",
                               response=shape.response("in_progress", []))
    else:
        opening = stream.start()
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        try:
            async for _, chunk in chunks:
                if said := opening + stream.chunk(chunk):
                    yield said
                opening = b""
        except PoolError as exc:
            if said := opening + stream.failed(exc):
                yield said
