"""Function calling over HTTP without a server: what a chat body's tools and tool_choice
ask of the pool, and how the output becomes OpenAI's tool calls, whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from modelpool.protocol.client_core import TextChunk, TextResult
from modelpool.protocol.errors import PoolError
from modelpool.protocol.messages import CallDelta, TokenLogprob, ToolCall
from modelpool.supervisor.httpapi import bodies, replies
from modelpool.supervisor.httpapi.chat import chat_call
from modelpool.supervisor.httpapi.tools import ToolCalls

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
CHAT = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}


def _call(**fields: Any) -> bodies.PoolCall:
    return chat_call(msgspec.convert({**CHAT, **fields}, type=bodies.ChatBody))


def test_a_named_function_holds_the_output_to_its_arguments() -> None:
    call = _call(tool_choice={"type": "function", "function": {"name": "weather"}})
    assert call.kwargs["json_schema"] == WEATHER and call.kwargs["tools"] == TOOLS
    no_arguments = _call(tool_choice={"type": "function", "function": {"name": "now"}})
    assert no_arguments.kwargs["json_schema"] == {"type": "object", "properties": {}}


def test_required_holds_it_to_a_list_of_calls_to_any_tool() -> None:
    schema = _call(tool_choice="required").kwargs["json_schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [o["properties"]["name"] for o in schema["items"]["anyOf"]] == [
        {"const": "weather"}, {"const": "now"}]
    one = _call(tool_choice="required", parallel_tool_calls=False).kwargs["json_schema"]
    assert one["maxItems"] == 1


def test_none_shows_the_tools_and_answers_in_text() -> None:
    call = _call(tool_choice="none")
    assert call.kwargs["tools"] == TOOLS and "json_schema" not in call.kwargs


@pytest.mark.parametrize("fields", [{}, {"tool_choice": "auto"}])
def test_auto_lets_the_model_call_in_its_own_format(fields: dict[str, Any]) -> None:
    call = _call(**fields)
    assert call.kwargs["tools"] == TOOLS and call.kwargs["tool_choice"] == "auto"
    assert "json_schema" not in call.kwargs and call.made is not None and call.made.auto
    # with a language of its own: the output held to it, calls read out of it all the same
    held = _call(response_format={"type": "json_object"})
    assert held.kwargs["tool_choice"] == "auto" and held.kwargs["json_schema"] == {
        "type": "object"}


def test_a_conversation_goes_on_after_calls_with_their_answers() -> None:
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    call = _call(messages=[{"role": "user", "content": "x"},
                           {"role": "assistant", "content": None, "tool_calls": calls},
                           {"role": "tool", "content": "rain", "tool_call_id": "call_1"}])
    (chat,) = call.args
    assert chat[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"name": "weather", "arguments": '{"city": "Oslo"}', "id": "call_1"}]}
    assert chat[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: messages\[0\].content: needed"):
        _call(messages=[{"role": "user", "content": None}])
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: messages\[0\].tool_calls: only"):
        _call(messages=[{"role": "user", "content": "x", "tool_calls": calls}])


@pytest.mark.parametrize(("fields", "says"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "another language"),
    ({"tools": [], "tool_choice": "required"}, "no tools"),
])
def test_what_cannot_be_made_into_calls_is_refused_by_name(fields: dict[str, Any],
                                                           says: str) -> None:
    with pytest.raises(PoolError, match=rf"^BAD_REQUEST: tool_choice: .*{says}"):
        _call(**fields)


def test_a_vision_request_takes_tools_as_a_chat_does() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgo="}}]}
    for choice, asked in (("auto", {"tool_choice": "auto"}), ("required", {"json_schema"})):
        call = _call(messages=[image], tool_choice=choice)
        assert call.op == "describe" and call.made is not None
        assert call.kwargs["tools"] == _call().kwargs["tools"]
        assert set(asked) <= set(call.kwargs)


def test_whole_answers_become_tool_calls() -> None:
    named = ToolCalls("weather").message('{"city": "Paris"}')
    assert named["content"] is None and len(named["tool_calls"]) == 1
    call = named["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    listed = ToolCalls(None).message('[{"name": "now", "parameters": {}}, '
                                     '{"name": "weather", "parameters": {"city": "Oslo"}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in listed["tool_calls"]] == [("now", {}), ("weather", {"city": "Oslo"})]
    assert ToolCalls(None).message('[{"name": "no') == {"role": "assistant",
                                                       "content": '[{"name": "no'}  # cut
    assert (ToolCalls("f").finish("stop"), ToolCalls(None).finish("stop"),
            ToolCalls(None).finish("length")) == ("stop", "tool_calls", "length")


def test_an_auto_answers_calls_come_beside_its_text() -> None:
    made = [ToolCall(name="weather", arguments='{"city":"Oslo"}'),
            ToolCall(name="now", arguments="{}")]
    auto = ToolCalls(None, auto=True)
    assert auto.message("Checking.", made)["content"] == "Checking."
    message = auto.message("", made)
    assert message["content"] is None and [c["function"] for c in message["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city":"Oslo"}'}, {"name": "now", "arguments": "{}"}]
    assert auto.message("just text", None) == {"role": "assistant", "content": "just text"}
    assert len(ToolCalls(None, auto=True, parallel=False).message("", made)["tool_calls"]) == 1
    assert (auto.finish("tool_calls"), auto.finish("stop")) == ("tool_calls", "stop")
    whole = replies.completion([TextResult("", "tool_calls", 5, 9, "m", tool_calls=made)],
                               chat=True, model="m", calls=auto)
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert len(whole["choices"][0]["message"]["tool_calls"]) == 2


def _events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n") if e]


def test_a_named_functions_arguments_stream_as_they_come() -> None:
    shape = replies.StreamShape(chat=True, model="m", include_usage=False,
                                calls=ToolCalls("weather"))
    data = shape.event(TextChunk('{"city": ')) + shape.event(TextChunk('"Rome"}', "stop", 3, 4))
    first, second = (e["choices"][0] for e in _events(data))
    call = first["delta"]["tool_calls"][0]
    assert first["delta"]["role"] == "assistant" and call["index"] == 0
    assert call["id"].startswith("call_") and call["function"] == {
        "name": "weather", "arguments": '{"city": '}
    assert second["delta"] == {"tool_calls": [{"index": 0,
                                               "function": {"arguments": '"Rome"}'}}]}
    assert second["finish_reason"] == "stop"


def test_an_auto_answers_text_streams_and_its_calls_come_last() -> None:
    shape = replies.StreamShape(chat=True, model="m", include_usage=False,
                                calls=ToolCalls(None, auto=True))
    made = [ToolCall(name="now", arguments="{}")]
    data = shape.event(TextChunk("Let me see.")) + shape.event(
        TextChunk("", "tool_calls", 3, 9, tool_calls=made))
    first, last = (e["choices"][0] for e in _events(data))
    assert first["delta"] == {"role": "assistant", "content": "Let me see."}
    assert first["finish_reason"] is None and last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["function"] == {
        "name": "now", "arguments": "{}"}


def test_a_list_of_calls_streams_once_whole_with_its_tokens_logprobs() -> None:
    shape = replies.StreamShape(chat=True, model="m", include_usage=False,
                                calls=ToolCalls(None))
    entry = TokenLogprob("[", 1, -0.5)
    assert shape.event(TextChunk('[{"name": "now", ', logprobs=[entry])) == b""
    data = shape.event(TextChunk('"parameters": {}}]', "stop", 3, 9, logprobs=[entry]))
    (choice,) = _events(data)[0]["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "now", "arguments": "{}"}
    assert len(choice["logprobs"]["content"]) == 2


def test_an_auto_answers_calls_stream_as_the_model_writes_them() -> None:
    """Each call's first piece names it, the next add to its arguments (what the SDK's
    accumulator joins); a call the worker did not stream comes whole with the last
    chunk, and one streamed is not sent again there."""
    shape = replies.StreamShape(chat=True, model="m", include_usage=False,
                                calls=ToolCalls(None, auto=True))
    made = [ToolCall(name="weather", arguments='{"city":"Rome"}', id="call_1"),
            ToolCall(name="now", arguments="{}", id="call_2")]
    data = (shape.event(TextChunk("Let me see.", calls=[
                CallDelta(index=0, name="weather", id="call_1", arguments="{")]))
            + shape.event(TextChunk("", calls=[CallDelta(index=0, arguments='"city":')]))
            + shape.event(TextChunk("", calls=[CallDelta(index=0, arguments='"Rome"}')]))
            + shape.event(TextChunk("", "tool_calls", 3, 9, tool_calls=made)))
    events = _events(data)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["tool_calls"] == [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "weather", "arguments": "{"}}]
    assert deltas[1]["tool_calls"] == [{"index": 0, "function": {"arguments": '"city":'}}]
    assert [c["index"] for c in deltas[3]["tool_calls"]] == [1]  # the one not streamed
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    message = state.get_final_completion().choices[0].message
    assert message.content == "Let me see."
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []
            ] == [("call_1", "weather", '{"city":"Rome"}'), ("call_2", "now", "{}")]
    one = replies.StreamShape(chat=True, model="m", include_usage=False,
                              calls=ToolCalls(None, auto=True, parallel=False))
    data = one.event(TextChunk("", calls=[CallDelta(index=0, name="now", id="call_3"),
                                          CallDelta(index=1, name="now", id="call_4")]))
    assert [c["id"] for c in _events(data)[0]["choices"][0]["delta"]["tool_calls"]] == [
        "call_3"]


def test_a_list_of_calls_streams_as_it_is_written_and_reads_the_same_whole() -> None:
    """tool_choice "required": each call of the list as its head and arguments come (the
    SDK's accumulator joins them), the same calls as the whole answer's."""
    listed = ['[{"name": "weather", "parameters": {"city"', ': "R\\u00f3me"}}, {"na',
              'me": "now", "parameters": {}}]']
    shape = replies.StreamShape(chat=True, model="m", include_usage=False,
                                calls=_call(tool_choice="required").made)
    events = _events(b"".join(shape.event(TextChunk(text)) for text in listed[:-1])
                     + shape.event(TextChunk(listed[-1], "stop", 3, 9)))
    assert [c["function"] for c in events[0]["choices"][0]["delta"]["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city"'}]  # before the list is whole
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    streamed = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    required = _call(tool_choice="required").made
    assert required is not None
    whole = required.message("".join(listed))["tool_calls"]
    assert streamed == [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [
        ("weather", '{"city":"R\\u00f3me"}'), ("now", "{}")]
