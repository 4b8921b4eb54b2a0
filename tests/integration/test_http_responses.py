"""OpenAI's Responses API through the official `openai` package (`responses.create`,
`.parse`, `.stream`, whose event accumulator checks every item's identity): each answer
is the chat completion of the same conversation, on the tiny random-weight Llama."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx2 as httpx
import openai
import pydantic
import pytest
from conftest import Daemon, model_entry
from http_helpers import KEY, data_url, http_daemon, long_llm, png

MODEL = "tiny-llm-long"
OTHER_KEY = "another-clients-key-7"  # a second client, whose kept responses are its own
INSTRUCTIONS = "You are a tiny model."
TOOL: Any = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: bool


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    workdir = tmp_path_factory.mktemp("http-responses")
    (workdir / "keys").write_text(OTHER_KEY + "\n")
    daemon, base = http_daemon(workdir, tiny_models_dir, extra=long_llm(tiny_models_dir)
                               + model_entry("caller", loader="calling_generator",
                                             capability="text_to_text", step_s=0.01),
                               http=f'api_key_file = "{workdir}/keys"')
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def sdk(served: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat(sdk: openai.OpenAI, messages: list[Any], **kw: Any) -> Any:
    return sdk.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_response_whole_and_streamed_is_the_chats_answer(sdk: openai.OpenAI) -> None:
    chat = _chat(sdk, [{"role": "system", "content": INSTRUCTIONS},
                       {"role": "user", "content": "tell me about workers"}], max_tokens=12)
    asked: Any = {"model": MODEL, "instructions": INSTRUCTIONS, "temperature": 0,
                  "input": "tell me about workers", "max_output_tokens": 12}
    whole = sdk.responses.create(**asked)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage is not None and chat.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    cut = chat.choices[0].finish_reason == "length"
    assert whole.status == ("incomplete" if cut else "completed")
    assert (whole.incomplete_details is not None) == cut and whole.store is True

    events = list(sdk.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] == ("response.incomplete" if cut else "response.completed")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.usage == whole.usage


def test_a_streams_opening_events_leave_with_its_first_text(
        served: tuple[Daemon, str]) -> None:
    """created, in_progress and the first delta in one HTTP chunk (one write): sent
    apart, the client waited for a second write, and woke twice, for its first token."""
    body = json.dumps({"model": MODEL, "input": "tell me about workers", "stream": True,
                       "temperature": 0, "max_output_tokens": 8}).encode()
    host, port = served[1].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        head, rest = reply.split(b"\r\n\r\n", 1)
        assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" in head.lower()
        while b"\r\n" not in rest:
            rest += sock.recv(65536)
        size, rest = rest.split(b"\r\n", 1)
        while len(rest) < int(size, 16):
            rest += sock.recv(65536)
    first = rest[:int(size, 16)]
    kinds = [line.removeprefix(b"event: ") for line in first.split(b"\n")
             if line.startswith(b"event: ")]
    assert kinds[:2] == [b"response.created", b"response.in_progress"]
    assert b"response.output_text.delta" in kinds


def test_structured_output_through_parse_and_stream(sdk: openai.OpenAI) -> None:
    """text.format json_schema (what `responses.parse` sends for a pydantic model) holds
    the output to the schema, as chat's response_format does; streamed, the SDK's
    accumulator takes every event and parses the final text."""
    messages: Any = [{"role": "user", "content": "weather?"}]
    parsed = sdk.responses.parse(model=MODEL, input=messages, text_format=Weather,
                                 max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Weather)
    chat = sdk.chat.completions.parse(model=MODEL, messages=messages, max_tokens=60,
                                      temperature=0, response_format=Weather)
    assert parsed.output_text == chat.choices[0].message.content
    with sdk.responses.stream(model=MODEL, input=messages, text_format=Weather,
                              max_output_tokens=60, temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == parsed.output_text and final.output_parsed == parsed.output_parsed


def test_function_calls_named_and_required_whole_and_streamed(sdk: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "weather in Paris?"}]
    named: Any = {"type": "function", "name": "get_weather"}
    whole = sdk.responses.create(model=MODEL, input=messages, tools=[TOOL], tool_choice=named,
                                 max_output_tokens=40, temperature=0)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert call.call_id.startswith("call_") and whole.status == "completed"
    chat = _chat(sdk, messages, max_tokens=40, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, tools=[{
            "type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}])
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments  # type: ignore[index,union-attr]
    with sdk.responses.stream(model=MODEL, input=messages, tools=[TOOL], tool_choice=named,
                              max_output_tokens=40, temperature=0) as stream:
        pieces = [e.delta for e in stream
                  if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert "".join(pieces) == call.arguments == final.output[0].arguments  # type: ignore[union-attr]
    listed = sdk.responses.create(model=MODEL, input=messages, tools=[TOOL],
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_output_tokens=80, temperature=0.8,
                                  extra_body={"seed": 2})
    assert [item.type for item in listed.output] == ["function_call"]
    with sdk.responses.stream(model=MODEL, input=messages, tools=[TOOL], tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=80, temperature=0.8,
                              extra_body={"seed": 2}) as stream:
        pieces = [e.delta for e in stream
                  if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert final.output[0].arguments == listed.output[0].arguments  # type: ignore[union-attr]
    assert len(pieces) > 1 and "".join(pieces) == final.output[0].arguments  # type: ignore[union-attr]


def test_an_auto_answers_call_streams_as_it_is_written_through_the_sdks_helpers(
        sdk: openai.OpenAI) -> None:
    """A model that calls (a test loader writing "tok0 " then a Hermes call, an argument
    a token): the Responses API's and chat's streams, each read by the SDK's helper."""
    tool: Any = {"type": "function", "name": "count", "parameters": {"type": "object"}}
    with sdk.responses.stream(model="caller", input="count", tools=[tool],
                              max_output_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    message, call = final.output
    assert message.type == "message" and final.output_text == "tok0 "
    assert call.type == "function_call" and call.name == "count"
    assert len(pieces) > 3 and "".join(pieces) == call.arguments
    assert json.loads(call.arguments) == {f"n{i}": i for i in range(4)}
    kinds = [e.type for e in events]  # the message done before the call began
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.function_call_arguments.delta")
    chat_tool: Any = {"type": "function", "function": {"name": "count"}}
    with sdk.chat.completions.stream(model="caller", messages=[
            {"role": "user", "content": "count"}], tools=[chat_tool], max_tokens=20) as chat:
        arguments = [e.arguments_delta for e in chat
                     if e.type == "tool_calls.function.arguments.delta"]
        answer = chat.get_final_completion().choices[0]
    (made,) = answer.message.tool_calls or []
    assert answer.finish_reason == "tool_calls" and made.function.name == "count"
    assert len(arguments) > 3 and "".join(arguments) == made.function.arguments == call.arguments


def test_a_conversation_of_input_items_is_the_chats(sdk: openai.OpenAI) -> None:
    """Messages with content parts, an answer's function call and its output: the same
    prompt, and the same answer, as the chat with the call and the tool's message."""
    items: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "weather in Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    answer = sdk.responses.create(model=MODEL, input=items, tools=[TOOL], tool_choice="none",
                                  max_output_tokens=8, temperature=0)
    chat = _chat(sdk, [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items()
                                                 if k != "type"}}],
        tool_choice="none", max_tokens=8)
    assert chat.usage is not None and answer.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > 100
    assert answer.output_text == chat.choices[0].message.content


def test_an_image_goes_to_the_vision_model(served: tuple[Daemon, str],
                                           sdk: openai.OpenAI) -> None:
    image = png((200, 30, 30))
    answer = sdk.responses.create(model="tiny-vision", max_output_tokens=6, temperature=0,
                                  input=[{"role": "user", "content": [
                                      {"type": "input_text", "text": "what is it?"},
                                      {"type": "input_image", "image_url": data_url(image),
                                       "detail": "auto"}]}])
    with served[0].client() as c:
        expected = "".join(ch.text for ch in c.describe(image, "what is it?",
                                                        model="tiny-vision", max_tokens=6,
                                                        temperature=0))
    assert answer.output_text == expected


@pytest.mark.parametrize(("extra", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "item_reference", "id": "msg_kept_by_none"}]}, "input[0]"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
])
def test_what_needs_a_kept_response_or_a_hosted_tool_is_refused_by_name(
        sdk: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", **extra}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(**body, stream=stream)
        assert refused.value.body["param"] == param  # type: ignore[index]


def test_an_unknown_model_is_a_404_before_any_event(sdk: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model="no-such-model", input="hi", stream=stream)


def _ended(sdk: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + 60
    while True:
        response = sdk.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_a_background_response_is_a_job_retrieved_whole(served: tuple[Daemon, str],
                                                        sdk: openai.OpenAI) -> None:
    """background: true answers queued at once; the SDK's retrieve, from any connection,
    shows it running and then its answer, the same as asked in the foreground."""
    asked: Any = {"model": MODEL, "input": "tell me about workers", "temperature": 0,
                  "max_output_tokens": 12}
    foreground = sdk.responses.create(**asked)
    queued = sdk.responses.create(**asked, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    other = openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    done = _ended(other, queued.id)
    assert done.id == queued.id and done.status == foreground.status
    assert done.output_text == foreground.output_text
    assert done.usage is not None and foreground.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        foreground.usage.input_tokens, foreground.usage.output_tokens)
    assert sdk.responses.cancel(queued.id).status == done.status  # ended: left as it is
    sdk.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(queued.id)


def test_a_background_response_cancelled_and_what_is_no_response(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """2,000 tokens of the counter take 100 s: cancelled, it ends at once."""
    queued = sdk.responses.create(model="counter", input="x", max_output_tokens=2000,
                                  background=True)
    assert sdk.responses.cancel(queued.id).status == "cancelled"
    assert sdk.responses.retrieve(queued.id).status == "cancelled"
    job = httpx.post(served[1] + "/v1/jobs", headers={"Authorization": f"Bearer {KEY}"},
                     json={"operation": "embeddings", "body": {"input": "x"}}).json()["id"]
    for missing in ("resp_" + "0" * 32, "msg_1", "resp_" + job):
        for asked in (sdk.responses.retrieve, sdk.responses.cancel, sdk.responses.delete):
            with pytest.raises(openai.NotFoundError):
                asked(missing)
    shown = httpx.get(f"{served[1]}/v1/jobs/{job}?wait=30", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}).json()
    assert shown["status"] == "done"  # a job of /v1/jobs: neither cancelled nor removed
    with pytest.raises(openai.BadRequestError) as error:
        sdk.responses.create(model=MODEL, input="hi", background=True, tools=[TOOL],
                             tool_choice="required")
    assert error.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_a_streamed_background_response_outlives_its_client_and_streams_again(
        sdk: openai.OpenAI) -> None:
    """background with stream: queued at once, then its events as the counter makes
    them (a token each 0.05 s); the client leaves and the response goes on, and its
    stream is taken up after the last event it had, through the SDK's helper and
    through retrieve's own stream."""
    created = sdk.responses.create(model="counter", input="x", max_output_tokens=24,
                                   background=True, stream=True)
    had = []
    for event in created:
        had.append(event)
        if event.type == "response.output_text.delta" and event.delta == "tok2 ":
            break
    created.close()  # the client leaves mid-stream
    assert [e.type for e in had[:3]] == ["response.created", "response.queued",
                                         "response.in_progress"]
    assert had[0].response.status == "queued" and had[0].response.background
    assert [e.sequence_number for e in had] == list(range(len(had)))
    response_id, last = had[0].response.id, had[-1].sequence_number
    with sdk.responses.stream(response_id=response_id, starting_after=last) as again:
        rest = list(again)
    # (the counter writes to its max_output_tokens: incomplete, which the SDK's
    # get_final_response does not take)
    assert rest[0].sequence_number == last + 1 and rest[-1].type == "response.incomplete"
    text = "".join(e.delta for e in [*had, *rest] if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text == "".join(f"tok{i} " for i in range(24))
    assert _ended(sdk, response_id).output_text == text  # kept as it finished
    # retrieve's own stream: the server leaves out the events up to starting_after
    raw = list(sdk.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [(e.type, e.sequence_number) for e in raw] == [
        (e.type, e.sequence_number) for e in rest]
    assert len(list(sdk.responses.retrieve(response_id, stream=True))) == last + 1 + len(rest)


def test_a_streamed_background_response_cancelled_ends_its_stream(sdk: openai.OpenAI) -> None:
    """2,000 tokens of the counter take 100 s: cancelled as its first text comes, its
    stream ends at once, the response cancelled."""
    events = []
    for event in sdk.responses.create(model="counter", input="x", max_output_tokens=2000,
                                      background=True, stream=True):
        events.append(event)
        if event.type == "response.in_progress":
            assert sdk.responses.cancel(event.response.id).status == "cancelled"
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "cancelled" and len(events) < 200


def test_what_does_not_stream_again(sdk: openai.OpenAI, served: tuple[Daemon, str]) -> None:
    answered = sdk.responses.create(model="counter", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:
        list(sdk.responses.retrieve(answered.id, stream=True))
    assert error.value.body["param"] == "stream"  # type: ignore[index]
    for query, param in (("stream=maybe", "stream"), ("starting_after=3", "starting_after"),
                         ("stream=true&starting_after=-1", "starting_after")):
        refused = httpx.get(f"{served[1]}/v1/responses/{answered.id}?{query}",
                            headers={"Authorization": f"Bearer {KEY}"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        list(sdk.responses.retrieve("resp_" + "0" * 32, stream=True))
