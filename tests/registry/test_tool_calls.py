"""Tool calls read out of a model's text, in its family's format (tool_choice "auto")."""

from __future__ import annotations

from typing import Any

import pytest

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import ToolCall
from modelpool.registry.loaders.tool_calls import (
    FORMATS,
    ToolCallReader,
    format_of,
    reader_for,
)

HERMES = FORMATS["hermes"]
LLAMA3 = FORMATS["llama3_json"]
WEATHER = ToolCall(name="get_weather", arguments='{"city":"Paris"}')
TIME = ToolCall(name="get_time", arguments="{}")


def _read(tool_format: str, text: str, piece: int) -> tuple[list[str], str, list[ToolCall]]:
    """The text passed on after each piece of `piece` characters, what finish() gave
    back, and the calls."""
    reader = ToolCallReader(FORMATS[tool_format])
    passed = [reader.feed(text[i:i + piece]) for i in range(0, len(text), piece)]
    rest, calls = reader.finish()
    return passed, rest, calls


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_calls_after_text_in_pieces_of_any_size(piece: int) -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
            "\n</tool_call>")
    passed, rest, calls = _read("hermes", text, piece)
    assert "".join(passed) + rest == "Let me look.\n"
    assert calls == [WEATHER, TIME]
    assert all("<" not in p for p in passed)  # nothing of a call's tag was passed on


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_text_that_only_looks_like_a_tag_is_passed_on_whole(piece: int) -> None:
    text = "a <tool a<tool_ca b <tool_callx c <tool_ca"
    passed, rest, calls = _read("hermes", text, piece)
    assert "".join(passed) + rest == text and calls == []
    assert "".join(passed) == text[:text.rindex("<")]  # only the last tag-like tail held


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"ci',  # cut short (length)
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>[1]</tool_call>',
])
def test_what_does_not_read_as_calls_comes_back_as_text(text: str) -> None:
    passed, rest, calls = _read("hermes", "Hi " + text, 5)
    assert "".join(passed) + rest == "Hi " + text and calls == []


def test_an_unterminated_last_block_and_string_arguments_are_calls() -> None:
    _, rest, calls = _read("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}',
                           3)
    assert rest == "" and calls == [ToolCall(name="f", arguments='{"a": 1}')]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_llama3_json_is_read_only_at_the_answers_start(piece: int) -> None:
    call = ' {"name": "get_weather", "parameters": {"city": "Paris"}}'
    passed, rest, calls = _read("llama3_json", call, piece)
    assert passed == [""] * len(passed) and rest == "" and calls == [WEATHER]
    several = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
              '{"name": "get_time", "parameters": {}}'
    assert _read("llama3_json", several, piece)[2] == [WEATHER, TIME]
    text = 'The answer: {"name": "x", "parameters": {}}'
    passed, rest, calls = _read("llama3_json", text, piece)
    assert "".join(passed) + rest == text and calls == []
    assert "".join(passed) == text  # decided at its first characters: nothing held
    passed, rest, calls = _read("llama3_json", '{"nam', piece)  # ended undecided
    assert "".join(passed) + rest == '{"nam' and calls == []


def test_the_format_comes_from_the_options_or_the_template() -> None:
    assert format_of("... <tool_call> ...", None, "m") is HERMES
    assert format_of("<|start_header_id|> ... parameters ...", None, "m") is LLAMA3
    assert format_of("<|python_tag|>", None, "m") is LLAMA3
    assert format_of("<|im_start|>{{ message.content }}", None, "m") is None
    assert format_of(None, None, "m") is None
    assert format_of(None, "llama3_json", "m") is LLAMA3
    with pytest.raises(ValueError, match="tool_call_format 'qwen' is not one of"):
        format_of("<tool_call>", "qwen", "m")


def test_a_model_whose_format_is_not_known_refuses_auto() -> None:
    with pytest.raises(PoolError, match="tool-call format is not known") as refused:
        reader_for(None, "m")
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert isinstance(reader_for(HERMES, "m"), ToolCallReader)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_conversation_with_calls_and_their_answers_reaches_the_template(llm: Any) -> None:
    chat = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"name": "get_weather", "arguments": '{"city": "Paris"}', "id": "call_1"}]},
            {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}]
    text = llm.tokenizer.decode(llm.prompt_ids(kinds.build("generate", chat, tools=TOOLS)))
    # the arguments as a mapping, as templates expect: not their JSON text quoted again
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_the_tiny_models_format_is_hermes_and_a_model_without_one_refuses_auto(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert llm.tool_format is HERMES
    request = kinds.build("generate", [{"role": "user", "content": "hi"}], tools=TOOLS,
                          tool_choice="auto")
    assert isinstance(llm.prepare(request).tool_calls, ToolCallReader)
    assert llm.prepare(kinds.build("generate", "hi", tools=TOOLS)).tool_calls is None
    monkeypatch.setattr(llm, "tool_format", None)
    with pytest.raises(PoolError, match="tool-call format is not known"):
        llm.prepare(request)
