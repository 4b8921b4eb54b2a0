"""The Responses API's kept responses through the official `openai` package:
`previous_response_id` continues one, its input items are listed, an `item_reference`
names one's output item (or an input item of the client's own), a response not kept is
neither shown, listed nor continued, and a background one is kept with its options;
each answer is the chat completion of the whole conversation."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from conftest import Daemon
from test_http_responses import (
    INSTRUCTIONS,
    MODEL,
    OTHER_KEY,
    TOOL,
    _chat,
    _ended,
    sdk,
    served,
)

from modelpool.protocol.errors import PoolError

__all__ = ["sdk", "served"]  # this module's daemon and client: fixtures of their own here


def _then(sdk: openai.OpenAI, turns: list[Any], answer: Any, text: str,
          **kw: Any) -> tuple[Any, list[Any]]:
    """The chat completion of the turns, the answer and a new user message (what a
    response continuing `answer` asks), and the turns it makes."""
    turns = [*turns, {"role": "assistant", "content": answer.output_text},
             {"role": "user", "content": text}]
    return _chat(sdk, turns, **kw), turns


def test_previous_response_id_continues_the_kept_conversation(sdk: openai.OpenAI) -> None:
    """Each response continued by its id, whole then streamed: its prompt and answer are
    the chat's of the whole conversation (the first instructions not carried over); the
    kept responses are retrieved as they were answered."""
    first = sdk.responses.create(model=MODEL, instructions=INSTRUCTIONS, temperature=0,
                                 input="tell me about workers", max_output_tokens=8)
    assert first.store is True
    second = sdk.responses.create(model=MODEL, previous_response_id=first.id, temperature=0,
                                  input="and queues?", max_output_tokens=8)
    chat, turns = _then(sdk, [{"role": "user", "content": "tell me about workers"}], first,
                        "and queues?", max_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    events = list(sdk.responses.create(model=MODEL, previous_response_id=second.id,
                                       input="why?", max_output_tokens=8, temperature=0,
                                       stream=True))
    third: Any = events[-1].response  # type: ignore[union-attr]
    chat, _ = _then(sdk, turns, second, "why?", max_tokens=8)
    assert third.usage is not None and chat.usage is not None
    assert third.usage.input_tokens == chat.usage.prompt_tokens
    assert third.output_text == chat.choices[0].message.content
    for answered in (first, second, third):
        assert sdk.responses.retrieve(answered.id).model_dump() == answered.model_dump()
    _lists_the_conversation(sdk, third.id, [
        ("user", "tell me about workers"), ("assistant", first.output_text),
        ("user", "and queues?"), ("assistant", second.output_text), ("user", "why?")])
    assert [i.id for i in sdk.responses.input_items.list(third.id, order="asc")][1::2] == [
        first.output[0].id, second.output[0].id]  # an answer's items keep their ids


def _lists_the_conversation(sdk: openai.OpenAI, response_id: str,
                            said: list[tuple[str, str]]) -> None:
    """GET /v1/responses/{id}/input_items: the messages before its answer, oldest first
    in ascending order, a page at a time (the SDK follows the pages)."""
    items: Any = list(sdk.responses.input_items.list(response_id, order="asc"))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [
        ("message", role, text) for role, text in said]
    first = sdk.responses.input_items.list(response_id, limit=2)  # latest first
    assert [i.id for i in first.data] == [i.id for i in items[::-1][:2]]
    assert first.has_more is (len(said) > 2)
    paged = [i.id for i in sdk.responses.input_items.list(response_id, limit=2)]
    assert paged == [i.id for i in items[::-1]] and len(set(paged)) == len(said)


def test_a_function_calls_output_continues_the_response_that_called(
        sdk: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {k: v for k, v in TOOL.items()
                                                    if k != "type"}}]
    called = sdk.responses.create(model=MODEL, input="weather in Paris?", tools=[TOOL],
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  max_output_tokens=40, temperature=0)
    (call,) = called.output
    assert call.type == "function_call"
    answer = sdk.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[TOOL], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=8, temperature=0)
    chat = _chat(sdk, [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name,
                                                           "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=tools, tool_choice="none", max_tokens=8)
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content
    items: Any = list(sdk.responses.input_items.list(answer.id, order="asc"))
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[1].id, items[1].name, items[1].arguments) == (call.id, call.name,
                                                                call.arguments)
    assert (items[2].call_id, items[2].output) == (call.call_id, "sunny")


def test_item_references_stand_for_kept_responses_output_items(sdk: openai.OpenAI) -> None:
    """A client that sends the whole conversation each turn may name the items it was
    given by their ids (as Codex does): each is the kept item, and the answer the chat's
    of the conversation they make; an item no kept response holds any longer (its own
    deleted, and the one it was named in) is refused."""
    said = sdk.responses.create(model=MODEL, input="tell me about workers", temperature=0,
                                max_output_tokens=6)
    called = sdk.responses.create(model=MODEL, input="weather in Paris?", tools=[TOOL],
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  max_output_tokens=40, temperature=0)
    (message,), (call,) = said.output, called.output
    assert message.type == "message" and call.type == "function_call"
    answer = sdk.responses.create(model=MODEL, tools=[TOOL], tool_choice="none", input=[
        {"role": "user", "content": "tell me about workers"},
        {"type": "item_reference", "id": message.id},
        {"role": "user", "content": "weather in Paris?"},
        {"type": "item_reference", "id": call.id},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=8, temperature=0)
    chat = _chat(sdk, [
        {"role": "user", "content": "tell me about workers"},
        {"role": "assistant", "content": said.output_text},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name,
                                                           "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items()
                                                 if k != "type"}}],
        tool_choice="none", max_tokens=8)
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content
    sdk.responses.delete(said.id)
    sdk.responses.delete(answer.id)  # it holds the items it named, as its input
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model=MODEL, stream=stream, input=[
                {"type": "item_reference", "id": call.id},
                {"type": "item_reference", "id": message.id}])
        assert refused.value.body["param"] == "input[1]"  # type: ignore[index]


def test_item_references_stand_for_the_clients_own_kept_input_items(
        sdk: openai.OpenAI, served: tuple[Daemon, str]) -> None:
    """An input item of a kept response, by the id it is listed with (its own, sent with
    it, or a new one), stands for that item for the client it was kept for; another
    client's reference to it is refused (a client's own ids may be guessed)."""
    first = sdk.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"type": "message", "role": "user", "content": "tell me about workers"},
        {"type": "message", "role": "user", "content": "and queues?", "id": "msg_mine"}])
    listed = [item.id for item in sdk.responses.input_items.list(first.id, order="asc")]
    assert listed[1] == "msg_mine" and listed[0].startswith("msg_")
    answer = sdk.responses.create(model=MODEL, temperature=0, max_output_tokens=8, input=[
        {"type": "item_reference", "id": item_id} for item_id in listed])
    chat = _chat(sdk, [{"role": "user", "content": "tell me about workers"},
                       {"role": "user", "content": "and queues?"}], max_tokens=8)
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content
    other = openai.OpenAI(base_url=served[1] + "/v1", api_key=OTHER_KEY, max_retries=0,
                          timeout=60)
    for item_id in listed:
        with pytest.raises(openai.BadRequestError) as refused:
            other.responses.create(model=MODEL, input=[
                {"type": "item_reference", "id": item_id}])
        assert refused.value.body["param"] == "input[0]"  # type: ignore[index]
    sdk.responses.delete(first.id)
    sdk.responses.delete(answer.id)
    with pytest.raises(openai.BadRequestError):
        sdk.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_mine"}])


def test_what_is_not_kept_is_neither_shown_nor_continued(sdk: openai.OpenAI) -> None:
    unkept = sdk.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=4)
    deleted = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(deleted.id)  # only a background one's job can be
    sdk.responses.delete(deleted.id)
    assert unkept.store is False
    for gone in (unkept.id, deleted.id):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.input_items.list(gone)
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model=MODEL, input="more", previous_response_id=gone)
        assert refused.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
        assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_long:  # no id is echoed at any length
        sdk.responses.create(model=MODEL, input="more", previous_response_id="r" * 129)
    assert too_long.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_background_response_is_kept_with_its_options_and_continued(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """Once seen finished, it is kept as answered: its job's result removed (as it is an
    hour after the job ended), it is still retrieved and continued."""
    running = sdk.responses.create(model="counter", input="x", max_output_tokens=2000,
                                   background=True)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="counter", input="y", previous_response_id=running.id)
    assert "only a finished response" in refused.value.message
    sdk.responses.cancel(running.id)
    queued = sdk.responses.create(model=MODEL, instructions=INSTRUCTIONS, temperature=0,
                                  input="tell me about workers", max_output_tokens=8,
                                  metadata={"run": "7"}, background=True)
    done = _ended(sdk, queued.id)
    assert done.status in ("completed", "incomplete") and done.store is True
    assert (done.instructions, done.metadata, done.max_output_tokens, done.temperature) == (
        INSTRUCTIONS, {"run": "7"}, 8, 0)
    _lists_the_conversation(sdk, queued.id, [("user", "tell me about workers")])
    with served[0].client() as c:
        c.forget(queued.id.removeprefix("resp_"))
        with pytest.raises(PoolError):
            c.job(queued.id.removeprefix("resp_"))
    assert sdk.responses.retrieve(queued.id).model_dump() == done.model_dump()
    answer = sdk.responses.create(model=MODEL, previous_response_id=queued.id,
                                  input="and queues?", max_output_tokens=8, temperature=0)
    chat, _ = _then(sdk, [{"role": "user", "content": "tell me about workers"}], done,
                    "and queues?", max_tokens=8)
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content
    sdk.responses.delete(queued.id)  # its job gone already: still deleted
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(queued.id)
