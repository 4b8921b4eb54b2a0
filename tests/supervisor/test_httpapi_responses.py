"""The Responses API without a server: a body's input items as chat messages, and the
answer's events, checked by the openai SDK's own stream accumulator (which refuses an
item whose identity changes, or a response completed with an item unfinished)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import msgspec
import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from starlette.requests import Request

from modelpool.protocol.client_core import TextChunk, TextResult
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import CallDelta, TokenLogprob, ToolCall
from modelpool.supervisor.httpapi.bodies import ChatMessage, ContentPart
from modelpool.supervisor.httpapi.replies import HttpError
from modelpool.supervisor.httpapi.responses_api import ResponsesApi, _owner
from modelpool.supervisor.httpapi.responses_in import (
    ResponsesBody,
    chat_body,
    continued,
    conversation,
    responses_call,
)
from modelpool.supervisor.httpapi.responses_items import kept_items
from modelpool.supervisor.httpapi.responses_out import (
    ResponseShape,
    ResponseStream,
    background,
    item_response_id,
)
from modelpool.supervisor.httpapi.settings import HttpSettings
from modelpool.supervisor.httpapi.tools import ToolCalls

TOOL = {"type": "function", "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _body(**fields: Any) -> ResponsesBody:
    return msgspec.convert({"input": "hi", **fields}, type=ResponsesBody)


def _roles(messages: list[ChatMessage]) -> list[tuple[str, Any, list[str]]]:
    return [(m.role, m.content, [c.id for c in m.tool_calls or []]) for m in messages]


def test_instructions_and_input_items_become_the_chats_messages() -> None:
    body = _body(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],  # earlier thinking: left out
         "content": [{"type": "reasoning_text", "text": "A call, then."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"}])
    messages = chat_body(body).messages
    assert [(role, ids) for role, _, ids in _roles(messages)] == [
        ("system", []), ("user", []), ("assistant", ["c1", "c2"]), ("tool", []),
        ("assistant", ["c3"])]
    assert messages[0].content == "be brief" and messages[3].tool_call_id == "c1"
    call = responses_call(body)
    pool = call.args[0]
    assert pool[2] == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"name": "weather", "arguments": "{}", "id": "c1"},
        {"name": "weather", "arguments": "{}", "id": "c2"}]}
    assert pool[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_a_continued_response_follows_its_conversation_and_answer() -> None:
    """previous_response_id: the kept conversation, the answer's output items (its
    message and calls, joined as a chat answer holds them), then the new input; the new
    instructions first, the old ones not carried over."""
    first = _body(instructions="old", input=[{"role": "user", "content": "weather?"}])
    kept = kept_items(first.input)
    assert kept == [{"type": "message", "role": "user", "content": "weather?",
                     "id": kept[0]["id"]}] and kept[0]["id"].startswith("msg_")
    shape = ResponseShape(first, "m", ToolCalls(None, auto=True))
    output = shape.whole(TextResult(
        text="Checking.", finish_reason="tool_calls", prompt_tokens=3, completion_tokens=9,
        model="m", tool_calls=[ToolCall(name="weather", arguments='{"city": "Oslo"}',
                                        id="c9")]))["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    turns = conversation(_body(instructions="new", input=[
        {"type": "function_call_output", "call_id": "c9", "output": "sunny"}]),
        continued([*kept, *output]))
    messages = chat_body(_body(instructions="new"), turns).messages
    assert _roles(messages) == [("system", "new", []), ("user", "weather?", []),
                                ("assistant", [ContentPart(type="text", text="Checking.")],
                                 ["c9"]), ("tool", "sunny", [])]
    assert messages[2].tool_calls[0].function.arguments == '{"city": "Oslo"}'  # type: ignore[index]
    assert continued(kept) == [ChatMessage(role="user", content="weather?")]  # unchanged


def test_an_output_items_id_names_its_response() -> None:
    shape = ResponseShape(_body(input="hi"), "m", None)
    for item_id in (shape.message_id(), shape.call_item_id(0), shape.call_item_id(12),
                    shape.reasoning_id()):
        assert item_response_id(item_id) == shape.id
    for other in ("msg_", "fc_", "fc_x", "rs_", "resp_abc", ""):
        assert item_response_id(other) is None


async def test_item_references_are_the_kept_items_within_the_bodys_bound() -> None:
    """Each item_reference becomes the kept output item it names; the items it names
    count against the body's bound, so a large item named again and again is a 413."""
    api: Any = SimpleNamespace(settings=HttpSettings(socket_path="/s", max_body_bytes=4000))
    responses = ResponsesApi(api)
    shape = ResponseShape(_body(input="hi"), "m", None)
    await responses.kept.keep(shape.id, "owner", [], _body(input="hi"), shape.whole(TextResult(
        text="x" * 1000, finish_reason="stop", prompt_tokens=1, completion_tokens=9,
        model="m")))
    named = {"type": "item_reference", "id": shape.message_id()}
    request = cast(Request, SimpleNamespace(headers={"authorization": "Bearer k"}))
    body = await responses._referenced(request, _body(input=[named] * 3))
    assert isinstance(body.input, list) and [i.type for i in body.input] == ["message"] * 3
    assert conversation(body, []) == [ChatMessage(role="assistant", content=[
        ContentPart(type="text", text="x" * 1000)])] * 3
    with pytest.raises(HttpError) as over:
        await responses._referenced(request, _body(input=[named] * 4))
    assert (over.value.status, over.value.param) == (413, "input")
    with pytest.raises(PoolError) as unknown:
        await responses._referenced(request, _body(input=[
            named, {"type": "item_reference", "id": "msg_" + "0" * 32}]))
    assert unknown.value.code is ErrorCode.BAD_REQUEST
    assert unknown.value.message.startswith("input[1]: ")
    assert "0" * 32 not in unknown.value.message  # no id is echoed


def test_a_kept_responses_owner_is_its_clients_identity_hashed_never_its_key() -> None:
    keyed = cast(Request, SimpleNamespace(headers={"authorization": "Bearer secret-key"}))
    other = cast(Request, SimpleNamespace(headers={"authorization": "Bearer other-key"}))
    assert "secret" not in _owner(keyed) and len(_owner(keyed)) == 64
    assert _owner(keyed) == _owner(keyed) != _owner(other)


def test_an_input_image_is_a_vision_request() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    call = responses_call(_body(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": url}]}]))
    assert call.op == "describe" and call.args[1] == [{"role": "user", "content": "what is it?"}]


def test_the_options_map_to_the_chats() -> None:
    call = responses_call(_body(
        max_output_tokens=7, temperature=0.5, top_p=0.9, tools=[TOOL],
        tool_choice={"type": "function", "name": "weather"}, top_logprobs=2,
        include=["message.output_text.logprobs"], priority="low", cache_salt="s",
        reasoning={"effort": "high"}))
    kw = call.kwargs
    assert (kw["max_tokens"], kw["temperature"], kw["top_p"], kw["logprobs"]) == (7, 0.5, 0.9, 2)
    assert kw["reasoning_effort"] == "high"
    assert kw["priority"] == "low" and kw["cache_salt"] == "s"
    assert kw["json_schema"] == TOOL["parameters"] and call.made is not None
    assert kw["tools"] == [{"type": "function", "function": {
        "name": "weather", "parameters": TOOL["parameters"]}}]
    formatted = responses_call(_body(text={"format": {"type": "json_schema", "name": "x",
                                                      "schema": {"type": "array"}}}))
    assert formatted.kwargs["json_schema"] == {"type": "array"}
    # what asks for nothing is taken, as clients send their defaults
    responses_call(_body(reasoning={"effort": None}, include=[], truncation="disabled",
                         text={"format": {"type": "text"}, "verbosity": "medium"}))
    # top_logprobs without include asks for none, as OpenAI takes it
    assert responses_call(_body(top_logprobs=2)).kwargs["logprobs"] is None


@pytest.mark.parametrize(("fields", "named"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "file_search"}]}, "tools[0]"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
])
def test_what_is_not_served_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(PoolError) as refused:
        responses_call(_body(**fields))
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert refused.value.message.startswith(named + ":")


def _accepted(stream_bytes: bytes) -> tuple[list[Any], Any]:
    """The events as the SDK reads them, fed to its accumulator; and its final response."""
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    events = []
    for block in stream_bytes.decode().split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = construct_type(type_=ResponseStreamEvent, value=msgspec.json.decode(data[6:]))
        assert kind == f"event: {event.type}"
        state.handle_event(event)
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, state._completed_response


def _streamed(shape: ResponseShape, chunks: list[TextChunk]) -> bytes:
    stream = ResponseStream(shape)
    return stream.start() + b"".join(stream.chunk(c) for c in chunks)


def test_an_auto_answers_text_streams_and_its_calls_follow_as_items() -> None:
    shape = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None, auto=True))
    entry = TokenLogprob("Let", 5, -0.5, [])
    events, final = _accepted(_streamed(shape, [
        TextChunk("Let me ", logprobs=[entry]), TextChunk("check."),
        TextChunk("", "tool_calls", 9, 4, tool_calls=[
            ToolCall(name="weather", arguments='{"city": "Oslo"}', id="call_7")])]))
    assert [e.type for e in events][2:6] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta"]
    assert events[4].logprobs[0].token == "Let"
    assert final.status == "completed" and final.output_text == "Let me check."
    message, call = final.output
    assert message.type == "message" and message.content[0].logprobs[0].logprob == -0.5
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call", "call_7", "weather", '{"city": "Oslo"}')
    assert final.usage.input_tokens == 9 and final.usage.output_tokens == 4


def test_a_reasoning_models_thinking_streams_first_as_its_own_item() -> None:
    """Its thinking is item 0, done as the answer begins; the message and the calls
    follow it, whole and streamed alike, as the SDK's accumulator checks."""
    shape = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None, auto=True))
    chunks = [TextChunk("", reasoning="Weather, "), TextChunk("", reasoning="so a call."),
              TextChunk("Checking.", reasoning=""),
              TextChunk("", "tool_calls", 9, 4, tool_calls=[ToolCall(name="weather",
                                                                       arguments="{}")])]
    events, final = _accepted(_streamed(shape, chunks))
    assert [(e.type, getattr(e, "output_index", None)) for e in events][2:10] == [
        ("response.output_item.added", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.done", 0),
        ("response.output_item.done", 0), ("response.output_item.added", 1),
        ("response.content_part.added", 1), ("response.output_text.delta", 1)]
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Weather, so a call."
    whole = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None, auto=True)).whole(
        TextResult("Checking.", "tool_calls", 9, 4, "m", tool_calls=[
            ToolCall(name="weather", arguments="{}")], reasoning="Weather, so a call."))
    assert [(i["type"], i["status"]) for i in whole["output"]] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text",
                                              "text": "Weather, so a call."}]


def test_an_auto_answers_calls_stream_as_items_after_its_message_is_done() -> None:
    """Thinking, a message, then two calls: the first streamed as the model writes it
    (the message done as it begins), the second read only at the end (whole there)."""
    shape = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None, auto=True))
    made = [ToolCall(name="weather", arguments='{"city":"Oslo"}', id="call_7"),
            ToolCall(name="weather", arguments="{}", id="call_8")]
    events, final = _accepted(_streamed(shape, [
        TextChunk("", reasoning="A call."), TextChunk("Checking."),
        TextChunk("", calls=[CallDelta(index=0, name="weather", id="call_7", arguments="{")]),
        TextChunk("", calls=[CallDelta(index=0, arguments='"city":"Oslo"}')]),
        TextChunk("", "tool_calls", 9, 4, tool_calls=made)]))
    assert [(e.type, getattr(e, "output_index", None)) for e in events][9:19] == [
        ("response.output_text.done", 1), ("response.content_part.done", 1),
        ("response.output_item.done", 1), ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.output_item.added", 3), ("response.function_call_arguments.delta", 3)]
    assert events[12].item.call_id == "call_7" and events[12].item.name == "weather"
    assert [(i.type, getattr(i, "call_id", None)) for i in final.output] == [
        ("reasoning", None), ("message", None), ("function_call", "call_7"),
        ("function_call", "call_8")]
    assert final.output[2].arguments == '{"city":"Oslo"}' and final.output_text == "Checking."
    assert len([e for e in events if e.type == "response.output_item.done"]) == 4


def test_a_required_list_of_calls_streams_each_call_as_an_item() -> None:
    required = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None, names=frozenset(
        {"weather"})))
    events, final = _accepted(_streamed(required, [
        TextChunk('[{"name": "weather", "parameters": {"city": '),
        TextChunk('"Oslo"}}, {"name": "weather", "parameters": {}}]', "stop", 3, 9)]))
    pieces = [(e.output_index, e.delta) for e in events
              if e.type == "response.function_call_arguments.delta"]
    assert pieces == [(0, '{"city":'), (0, '"Oslo"}'), (1, "{}")]
    assert [(i.name, i.arguments) for i in final.output] == [
        ("weather", '{"city":"Oslo"}'), ("weather", "{}")]
    assert events[2].item.call_id == final.output[0].call_id  # the streamed call's id


def test_calls_alone_take_the_first_place_and_a_cut_answer_is_incomplete() -> None:
    shape = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None, auto=True))
    _, final = _accepted(_streamed(shape, [TextChunk("", "tool_calls", 3, 2, tool_calls=[
        ToolCall(name="weather", arguments="{}")])]))
    assert [item.type for item in final.output] == ["function_call"]
    cut = _streamed(ResponseShape(_body(), "m", None),
                    [TextChunk("a"), TextChunk("b", "length", 3, 2)])
    events, _ = _accepted(cut)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].status == "incomplete"


def test_a_list_of_calls_is_held_until_whole_and_a_named_call_streams() -> None:
    required = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls(None))
    events, final = _accepted(_streamed(required, [
        TextChunk('[{"name": "weather", '), TextChunk('"parameters": {}}]', "stop", 3, 9)]))
    assert [e.type for e in events][2:4] == ["response.output_item.added",
                                             "response.function_call_arguments.delta"]
    assert [(i.name, i.arguments) for i in final.output] == [("weather", "{}")]
    named = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls("weather"))
    events, final = _accepted(_streamed(named, [
        TextChunk('{"city"'), TextChunk(': "Oslo"}', "stop", 3, 9)]))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas == ['{"city"', ': "Oslo"}']
    assert final.output[0].arguments == '{"city": "Oslo"}'
    # after thinking: its item follows the reasoning item's, the arguments under its id
    thought = ResponseShape(_body(tools=[TOOL]), "m", ToolCalls("weather"))
    events, final = _accepted(_streamed(thought, [
        TextChunk("", reasoning="Oslo, I think."), TextChunk('{"city": "Oslo"}'),
        TextChunk("", "stop", 3, 9)]))
    assert [(e.type, e.output_index) for e in events if "output_item" in e.type] == [
        ("response.output_item.added", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.output_item.done", 1)]
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == '{"city": "Oslo"}'


def test_an_empty_answer_still_has_its_message_and_a_failure_ends_the_stream() -> None:
    shape = ResponseShape(_body(), "m", None)
    _, final = _accepted(_streamed(shape, [TextChunk("", "stop", 3, 0)]))
    assert final.output_text == "" and final.output[0].type == "message"
    stream = ResponseStream(shape)
    failed = stream.start() + stream.chunk(TextChunk("a")) + stream.failed(
        PoolError(ErrorCode.WORKER_DIED, "the worker died"))
    events, _ = _accepted(failed)
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "worker_died"


def test_a_background_response_is_its_jobs_state() -> None:
    info = {"key": "ab12", "model": "m", "submitted_at": 1700000000.5, "state": "queued"}
    assert (background(info, None)["id"], background(info, None)["status"]) == (
        "resp_ab12", "queued")
    assert background({**info, "state": "running"}, None)["status"] == "in_progress"
    failed = background({**info, "state": "failed", "error_code": "WORKER_DIED",
                         "error_message": "gone"}, None)
    assert failed["status"] == "failed" and failed["error"] == {"code": "worker_died",
                                                                "message": "gone"}
    cancelled = background({**info, "state": "cancelled", "error_code": "CANCELLED"}, None)
    assert cancelled["status"] == "cancelled" and cancelled["error"] is None
    done = background({**info, "state": "done"}, TextResult(
        "", "tool_calls", 5, 3, "m", tool_calls=[ToolCall(name="weather", arguments="{}")]))
    assert done["status"] == "completed" and done["background"] is True
    assert [item["type"] for item in done["output"]] == ["function_call"]
    assert done["created_at"] == 1700000000 and done["usage"]["total_tokens"] == 8
