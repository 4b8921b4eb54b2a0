"""Structured output over HTTP without a server: each way a body asks for a language
(OpenAI's response_format, vLLM's structured_outputs and guided_* fields) becomes the
client's one keyword, and asking twice is refused by name."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from modelpool.protocol.errors import PoolError
from modelpool.supervisor.httpapi import bodies, completions
from modelpool.supervisor.httpapi.chat import chat_call

CHAT = {"messages": [{"role": "user", "content": "x"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
LANGUAGES = ("json_schema", "regex", "choice", "grammar")


def _asked(kind: type = bodies.ChatBody, **fields: Any) -> dict[str, Any]:
    base = CHAT if kind is bodies.ChatBody else {"prompt": "p"}
    body = msgspec.convert({**base, **fields}, type=kind)  # as JSON gives it
    call = (chat_call if kind is bodies.ChatBody else completions.completion_call)(body)
    return {name: call.kwargs[name] for name in LANGUAGES if name in call.kwargs}


@pytest.mark.parametrize(("fields", "asked"), [
    ({}, {}),
    ({"response_format": {"type": "text"}}, {}),
    ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     {"json_schema": {"type": "object"}}),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
    ({"structured_outputs": {"json": '{"type": "string"}'}},
     {"json_schema": '{"type": "string"}'}),
    ({"structured_outputs": {"json_object": True}}, {"json_schema": {"type": "object"}}),
    ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"choice": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'start: "a"'}}, {"grammar": 'start: "a"'}),
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"guided_regex": "a+"}, {"regex": "a+"}),
    ({"guided_choice": ["a"]}, {"choice": ["a"]}),
    ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
])
def test_each_way_of_asking_becomes_one_keyword(fields: dict[str, Any],
                                                asked: dict[str, Any]) -> None:
    assert _asked(**fields) == asked
    assert _asked(bodies.CompletionBody, **fields) == asked  # vLLM takes them there too


def test_two_ways_of_asking_at_once_are_refused_by_the_first() -> None:
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: response_format: .*guided_regex"):
        _asked(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: structured_outputs: "):
        _asked(structured_outputs={"regex": "a"}, guided_choice=["a"])


def test_a_format_openai_does_not_have_is_refused_by_the_body() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"response_format\.type"):
        _asked(response_format={"type": "yaml"})
