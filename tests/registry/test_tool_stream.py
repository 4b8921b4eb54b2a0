"""Tool calls streamed as the model writes them (tool_choice "auto"): each call named as
its head is written, then its arguments piece by piece, the pieces joined being the
calls the whole text reads as."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_calls import DEEPSEEK_V3, DEEPSEEK_V31, JAMBA, KIMI, MINIMAX_M1, NAMES
from test_tool_calls_xml import CALLS, GLM, MINIMAX_M2, SEED_OSS, STEP3, TOOLS

from modelpool.protocol.messages import CallDelta, Sampling, ToolCall
from modelpool.registry.loaders.tool_calls import FORMATS, ToolCallReader, reader_for
from modelpool.registry.loaders.tool_stream import JsonObject
from modelpool.workers.capabilities.text_to_text import GenerationStats, TextOutput, end_reply

STREAMED = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris", "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {}}\n</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"days": [1, 2]}}; {"name": "get_time", "parameters": {}}'),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": [1, 2]}}, {"name": "get_time", "arguments": {}}]'),
    "granite": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": [1, 2]}}, {"name": "get_time", "arguments": {}}]'),
    "internlm": ('Looking. <|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
                 '{"city": "Paris", "days": [1, 2]}}<|action_end|>\n<|action_start|><|plugin|>'
                 '\n{"name": "get_time", "parameters": {}}<|action_end|>'),
    "deepseek": DEEPSEEK_V3, "kimi_k2": KIMI, "minimax": MINIMAX_M1,
    "xlam": ('```json\n[{"name": "get_weather", "arguments": {"city": "Paris", "days": '
             '[1, 2]}}, {"name": "get_time", "arguments": {}}]\n```'),
    "longcat": ('Let me look.\n<longcat_tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "days": [1, 2]}}\n</longcat_tool_call>\n<longcat_tool_call>'
                '\n{"name": "get_time", "arguments": {}}\n</longcat_tool_call>'),
}
# Olmo 3's: its template's values as JSON, a call a line
OLMO3 = ('Let me look.<function_calls>get_weather(city="Paris (\\"FR\\")", days=[1, (2)], '
         'metric=true, near=null)\nget_time()</function_calls>')
XLAM = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", ' \
       '"arguments": {}}]'
CASES = [*STREAMED.items(), ("deepseek", DEEPSEEK_V31), ("jamba", JAMBA),
         ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'),
         ("xlam", XLAM), ("xlam", f"```\n{XLAM}\n```")]


def _stream(tool_format: str, text: str, piece: int
            ) -> tuple[list[tuple[int, CallDelta]], str, list[ToolCall], ToolCallReader]:
    """Each delta with how much of the text had been fed when it came, the text passed
    on, the calls, and the reader."""
    reader = (ToolCallReader(FORMATS[tool_format], NAMES) if "xml" not in tool_format
              else reader_for(FORMATS[tool_format.removesuffix("_xml")], "m", TOOLS))
    deltas, passed = [], ""
    for at in range(0, len(text), piece):
        passed += reader.feed(text[at:at + piece])
        deltas += [(min(at + piece, len(text)), d) for d in reader.take_deltas()]
    rest, calls = reader.finish()
    deltas += [(len(text), d) for d in reader.take_deltas()]
    return deltas, passed + rest, calls, reader


def _joined(deltas: list[tuple[int, CallDelta]]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for _, delta in deltas:
        if delta.index not in calls:
            assert delta.name and delta.id and delta.arguments  # its first piece names it
            assert delta.index == len(calls)  # in order, none skipped
            calls[delta.index] = ToolCall(name=delta.name, arguments="", id=delta.id)
        else:
            assert not delta.name and not delta.id
        call = calls[delta.index]
        calls[delta.index] = ToolCall(name=call.name, arguments=call.arguments + delta.arguments,
                                      id=call.id)
    return list(calls.values())


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize(("tool_format", "text"), CASES)
def test_each_formats_calls_stream_and_join_to_the_calls_read(tool_format: str, text: str,
                                                              piece: int) -> None:
    deltas, passed, calls, reader = _stream(tool_format, text, piece)
    assert _joined(deltas) == calls and not reader.cut
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"} if "days" not in text else
         {"city": "Paris", "days": [1, 2]}), ("get_time", {})]
    assert "<" not in passed and "[TOOL" not in passed
    if piece == 1:  # the first call's arguments came in pieces, before its end was written
        first = [at for at, d in deltas if d.index == 0]
        assert len(first) > 5 and first[0] < text.index("Paris")
        assert first[-1] == text.index("}", text.index("Paris")) + 1  # its closing brace
        assert next(at for at, d in deltas if d.index == 1) < len(text)


def test_arguments_keep_their_strings_and_lose_the_white_space_between_tokens() -> None:
    text = ('<tool_call>{"name": "f", "arguments": {\n  "q": "a  b \\" }\\n",\n  '
            '"e": "caf\\u00e9", "n": [1, {"x": null}] }\n}</tool_call>')
    deltas, _, calls, _ = _stream("hermes", text, 1)
    assert _joined(deltas) == calls
    assert calls[0].arguments == '{"q":"a  b \\" }\\n","e":"caf\\u00e9","n":[1,{"x":null}]}'
    assert json.loads(calls[0].arguments) == {"q": 'a  b " }\n', "e": "café",
                                              "n": [1, {"x": None}]}


def test_a_json_objects_end_is_found_as_its_text_comes() -> None:
    scanner = JsonObject()
    assert scanner.feed('{"a": "}{\\"') == ('{"a":"}{\\"', None)
    assert scanner.feed('", "b": [1, {}]} trailing') == ('","b":[1,{}]}', 16)


@pytest.mark.parametrize("piece", [1, 1000])
def test_a_call_streamed_then_cut_short_stands_as_streamed(piece: int) -> None:
    """As OpenAI sends a call cut by max_tokens: its arguments so far; the answer ends
    with the output's own reason, not tool_calls."""
    text = STREAMED["hermes"][:STREAMED["hermes"].index('"Paris"') + 4]
    deltas, passed, calls, reader = _stream("hermes", text, piece)
    assert passed == "Let me look.\n" and reader.cut
    assert _joined(deltas) == calls and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Par')]
    output = TextOutput(Sampling(), ToolCallReader(FORMATS["hermes"], NAMES))
    output.feed(text)
    _, made = output.finish()
    stats = GenerationStats(finish_reason="length")
    assert end_reply(1, stats, "length", made, output).finish_reason == "length"
    whole = TextOutput(Sampling(), ToolCallReader(FORMATS["hermes"], NAMES))
    whole.feed(STREAMED["hermes"])
    _, made = whole.finish()
    assert end_reply(1, stats, "stop", made, whole).finish_reason == "tool_calls"


@pytest.mark.parametrize(("tool_format", "text", "calls"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     [("f", '{"a": 1}')]),  # arguments as a string: read whole at the end
    ("hermes", '<tool_call>{"arguments": {}, "name": "f"}</tool_call>', [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ("pythonic", '[(get_weather(city="Paris"))]', [("get_weather", '{"city":"Paris"}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>x</function>\n</tool_call>",
     [("get_time", "{}")]),  # a body that no parameter reads
])
def test_what_no_head_reads_comes_whole_at_the_end(tool_format: str, text: str,
                                                   calls: list[tuple[str, str]]) -> None:
    deltas, _, made, _ = _stream(tool_format, text, 2)
    assert deltas == [] and [(c.name, c.arguments) for c in made] == calls


def test_calls_after_one_that_streams_no_more_come_whole_with_the_streamed() -> None:
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    deltas, _, calls, reader = _stream("hermes", text, 4)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}"), ("f", "{}")]
    assert _joined(deltas) == calls[:1] and not reader.cut


@pytest.mark.parametrize("piece", [1, 5, 1000])
@pytest.mark.parametrize(("tool_format", "text", "parameters"), [
    ("qwen3_coder", CALLS, 7), ("glm45", GLM, 2), ("minimax_m2", MINIMAX_M2, 3),
    ("seed_oss", SEED_OSS, 7), ("step3", STEP3, 3)])
def test_xml_calls_stream_a_parameter_at_a_time_typed_by_the_schema(
        tool_format: str, text: str, parameters: int, piece: int) -> None:
    deltas, passed, calls, reader = _stream(tool_format + "_xml", text, piece)
    assert _joined(deltas) == calls and not reader.cut and "<" not in passed
    assert [c.name for c in calls] == ["get_weather", "get_time"] and calls[1].arguments == "{}"
    assert json.loads(calls[0].arguments)["days"] == 3
    if piece == 1:  # each parameter as its closing tag is written, then the closing brace
        first = [at for at, d in deltas if d.index == 0]
        assert len(first) == parameters + 1
        closing = {"glm45": "</arg_value>", "step3": "</steptml:parameter>"}.get(
            tool_format, "</parameter>")
        assert first[0] == text.index(closing) + len(closing)


@pytest.mark.parametrize(("tool_format", "text", "streamed"), [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>"
     "\n<parameter=city>\nPar", '{"days":3'),  # cut short: its arguments so far
    ("qwen3_coder", "<function=get_time>\n</function>\nand then I", "{}"),  # text after
    ("minimax_m2", '<minimax:tool_call><invoke name="get_time"></invoke> and more', "{}"),
    ("glm45", "<tool_call>get_time</tool_call><tool_call>rm_rf</tool_call>", "{}"),
])
def test_an_xml_call_streamed_stands_whatever_follows(tool_format: str, text: str,
                                                      streamed: str) -> None:
    deltas, _, calls, reader = _stream(tool_format + "_xml", text, 3)
    assert _joined(deltas) == calls and [c.arguments for c in calls] == [streamed]
    assert reader.cut == (streamed != "{}")


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_pythonic_calls_stream_a_call_at_a_time(piece: int) -> None:
    text = (' <|python_start|>[get_weather(city="Paris (\\"FR\\")", days=[1, (2)]), '
            "get_time()]<|python_end|>")
    deltas, passed, calls, reader = _stream("pythonic", text, piece)
    assert passed == "" and _joined(deltas) == calls and not reader.cut
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris ("FR")', "days": [1, 2]}), ("get_time", {})]
    if piece == 1:  # each whole as its parenthesis closed
        assert [at for at, _ in deltas] == [text.index("]), ") + 2, text.index("()]") + 2]
    for streamed_first in ('[get_weather(city="Paris"), get_', '[get_weather(city="Paris")] x'):
        deltas, _, calls, reader = _stream("pythonic", streamed_first, piece)
        assert _joined(deltas) == calls and [c.name for c in calls] == ["get_weather"]
    assert _stream("pythonic", "[get_weather(city=x)]", piece)[:3] == (
        [], "[get_weather(city=x)]", [])  # a name, not a literal: text


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_olmo3s_calls_a_line_each_stream_a_call_at_a_time(piece: int) -> None:
    deltas, passed, calls, reader = _stream("olmo3", OLMO3, piece)
    assert passed == "Let me look." and _joined(deltas) == calls and not reader.cut
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris ("FR")', "days": [1, 2], "metric": True,
                         "near": None}), ("get_time", {})]
    if piece == 1:  # each whole as its parenthesis closed, the first before the second began
        assert [at for at, _ in deltas] == [OLMO3.index("null)") + 5, OLMO3.index("()<") + 2]
    cut = OLMO3[:OLMO3.index("get_time") + 5]  # cut short in the second call's name
    deltas, _, calls, reader = _stream("olmo3", cut, piece)
    assert _joined(deltas) == calls and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize(("tool_format", "text", "known"), [
    ("hermes", 'Hi <tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', '"rm_rf", "arguments":'),
    ("llama3_json", '{"name": "Bob", "parameters": {"age": 3}}', '"Bob", "parameters":'),
    ("pythonic", "[see the docs](https://example.com) for more", "[see t"),
    ("olmo3", "See <function_calls> in the docs", "<function_calls> in t"),
    ("olmo3", "<function_calls>rm_rf(path='/')</function_calls>", "<function_calls>rm_rf("),
    ("xlam", '```json\n[{"name": "rm_rf", "arguments": {}}]\n```', '"rm_rf", "arguments":'),
])
def test_what_cannot_read_as_calls_is_text_as_soon_as_that_is_known(
        tool_format: str, text: str, known: str) -> None:
    """A call to no tool (the whole reading would make it all text), or a list that no
    call can begin: passed on at once, not held to the end."""
    reader = ToolCallReader(FORMATS[tool_format], NAMES)
    end = text.index(known) + len(known)
    passed = "".join(reader.feed(text[i]) for i in range(end))
    assert passed == text[:end] and reader.take_deltas() == []
    passed += "".join(reader.feed(text[i]) for i in range(end, len(text)))
    assert passed == text and reader.finish() == ("", [])


def test_an_xlam_answer_that_is_no_list_of_calls_is_text_at_once() -> None:
    """Another code block, a JSON object in one: no call can begin, so no text is held."""
    for text in ("```python\nprint('hi')\n```", '```json\n{"a": 1}\n```', "Sure, [1]"):
        reader = ToolCallReader(FORMATS["xlam"], NAMES)
        passed = "".join(reader.feed(char) for char in text)
        assert passed == text[:len(passed)] and reader.plain and reader.finish() == (
            text[len(passed):], [])


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_phi4_minis_functools_list_read_and_streamed(piece: int) -> None:
    text = ('Sure. functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {}}]')
    deltas, passed, calls, _ = _stream("phi4_mini_json", text, piece)
    assert passed == "Sure. " and _joined(deltas) == calls
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]


# Pieces of every format's calls, for outputs made of them in any order
FRAGMENTS = sorted({*"{}[](),:;\"' \n\\", "<tool_call>", "</tool_call>", '{"name": ',
                    '"get_weather"', '"rm_rf"', '"arguments": ', '"parameters": ',
                    '{"city": "Paris"}', "[TOOL_CALLS]", "[ARGS]", "<|tool_call|>",
                    "<function=get_time>", "<parameter=n>", "</parameter>", "</function>",
                    "get_weather(", "city='Paris'", "<｜tool▁calls▁begin｜>",
                    "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                    "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>",
                    "<|tool_call_end|>", "<tool_calls>", "</tool_calls>", "functools[",
                    "<arg_key>k</arg_key><arg_value>v</arg_value>", "get_time", "```json",
                    '<invoke name="get_time">', "</invoke>", "<minimax:tool_call>", "text",
                    "<function_calls>", "</function_calls>", "get_time()", "true",
                    "<longcat_tool_call>", "</longcat_tool_call>"})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.lists(st.sampled_from(FRAGMENTS), max_size=40),
       st.integers(1, 9))
def test_any_output_reads_without_failing_and_its_pieces_join_to_its_calls(
        tool_format: str, fragments: list[str], piece: int) -> None:
    """Whatever a model writes, in pieces of any size: no exception, the text passed on
    and given back is the output less the calls, and what streamed joins to them."""
    _check_any(tool_format, "".join(fragments), piece)


WRITTEN = [*CASES, ("qwen3_coder", CALLS), ("glm45", GLM), ("minimax_m2", MINIMAX_M2),
           ("seed_oss", SEED_OSS), ("step3", STEP3), ("olmo3", OLMO3)]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(WRITTEN), st.integers(0, 400), st.integers(0, 400),
       st.sampled_from(FRAGMENTS), st.integers(1, 9))
def test_real_calls_cut_short_or_broken_anywhere_read_without_failing(
        written: tuple[str, str], cut: int, at: int, fragment: str, piece: int) -> None:
    tool_format, text = written
    text = text[:at] + fragment + text[at:]
    _check_any(tool_format, text[:len(text) - cut], piece)


def _check_any(tool_format: str, text: str, piece: int) -> None:
    reader = reader_for(FORMATS[tool_format], "m", TOOLS)
    deltas, passed = [], ""
    for at in range(0, len(text), piece):
        passed += reader.feed(text[at:at + piece])
        deltas += [(at, d) for d in reader.take_deltas()]
    rest, calls = reader.finish()
    deltas += [(len(text), d) for d in reader.take_deltas()]
    streamed = _joined(deltas)
    assert calls[:len(streamed)] == streamed
    assert text.startswith(passed + rest)
    if not calls:
        assert passed + rest == text


def test_internlms_interpreter_action_is_no_call() -> None:
    code = "<|action_start|><|interpreter|>\nprint(1)<|action_end|>"
    deltas, passed, calls, _ = _stream("internlm", "Let me run it. " + code, 3)
    assert (deltas, passed, calls) == ([], "Let me run it. " + code, [])
