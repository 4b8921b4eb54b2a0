"""Qwen3-Coder's XML tool calls: read from the model's text in pieces of any size, each
parameter's text given the type its tool's JSON schema says."""

from __future__ import annotations

import msgspec
import pytest

from modelpool.protocol.messages import ToolCall
from modelpool.registry.loaders.tool_calls import FORMATS, ToolCallReader, format_of, reader_for
from modelpool.registry.loaders.tool_calls_xml import parameter_types, parse_step3

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "celsius": {"type": "boolean"}, "threshold": {"type": ["number", "null"]},
            "hours": {"type": "array"}, "where": {"type": "object"}, "note": {}}}}},
    {"type": "function", "function": {"name": "get_time"}},
]
CALLS = """Let me look that up.
<tool_call>
<function=get_weather>
<parameter=city>
New York
</parameter>
<parameter=days>
3
</parameter>
<parameter=celsius>
False
</parameter>
<parameter=threshold>
2.5
</parameter>
<parameter=hours>
[9, 12]
</parameter>
<parameter=where>
{"lat": 40.7}
</parameter>
<parameter=note>
line one
line two
</parameter>
</function>
</tool_call>
<tool_call>
<function=get_time>
</function>
</tool_call>"""


def _read(text: str, piece: int, tool_format: str = "qwen3_coder"
          ) -> tuple[str, str, list[ToolCall]]:
    reader = reader_for(FORMATS[tool_format], "m", TOOLS)
    passed = "".join(reader.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    rest, calls = reader.finish()
    return passed, rest, [msgspec.structs.replace(c, id="") for c in calls]


@pytest.mark.parametrize("piece", [1, 3, 8, 10_000])
def test_calls_after_text_with_each_value_of_its_schemas_type(piece: int) -> None:
    passed, rest, calls = _read(CALLS, piece)
    assert passed + rest == "Let me look that up.\n" and "<" not in passed
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert msgspec.json.decode(calls[0].arguments) == {
        "city": "New York", "days": 3, "celsius": False, "threshold": 2.5,
        "hours": [9, 12], "where": {"lat": 40.7}, "note": "line one\nline two"}
    assert calls[1].arguments == "{}"


@pytest.mark.parametrize(("schema", "text", "value"), [
    ("string", "42", "42"),  # a string stays text, though it reads as a number
    ("integer", "4.5", "4.5"),  # not an integer: its text, for the client to judge
    ("number", "7", 7), ("number", "1e400", "1e400"), ("number", "inf", "inf"),
    ("boolean", "TRUE", True), ("boolean", "maybe", "maybe"),
    ("object", "{not json", "{not json"), ("integer", "null", None),
])
def test_each_type_read_or_its_text_kept(schema: str, text: str, value: object) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"x": {"type": schema}}}}}]
    reader = reader_for(FORMATS["qwen3_coder"], "m", tools)
    reader.feed(f"<tool_call>\n<function=f>\n<parameter=x>\n{text}\n</parameter>\n"
                "</function>\n</tool_call>")
    (call,) = reader.finish()[1]
    assert msgspec.json.decode(call.arguments) == {"x": value}


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",  # not among the tools
    "<tool_call>\n</tool_call>",  # no function
    "<tool_call>\n<function=get_time>\n<parameter=x>\n1\n</param",  # cut short
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call><function=get_time>x</function><function=get_time></function></tool_call>",
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # hermes' JSON
])
def test_what_is_no_call_comes_back_as_text(text: str) -> None:
    passed, rest, calls = _read(text, 4)
    assert passed + rest == text and calls == []


@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_bare_functions_without_tool_call_are_calls_as_vllm_reads_them(piece: int) -> None:
    """What Qwen3-Coder sometimes writes: its functions without the <tool_call> around."""
    bare = CALLS.replace("<tool_call>\n", "").replace("</tool_call>", "")
    passed, rest, calls = _read(bare, piece)
    assert passed + rest == "Let me look that up.\n" and "<" not in passed
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert msgspec.json.decode(calls[0].arguments)["days"] == 3
    for no_call in ("<function=get_time>\nx</function>\nand then I", "<function=get_we",
                    "<function=get_weather>\n<parameter=city>\nParis\n</para"):
        assert _read(no_call, piece) == ("", no_call, [])  # not a call, or cut short
    assert _read("a <function> tag", piece) == ("a <function> tag", "", [])


MINIMAX_M2 = """I will check both.
<minimax:tool_call>
<invoke name="get_weather">
<parameter name="city">New York</parameter>
<parameter name="days">3</parameter>
<parameter name="hours">[9, 12]</parameter>
</invoke>
<invoke name='get_time'>
</invoke>
</minimax:tool_call>"""


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_minimax_m2_invokes_with_each_value_of_its_schemas_type(piece: int) -> None:
    reader = reader_for(FORMATS["minimax_m2"], "m", TOOLS)
    passed = "".join(reader.feed(MINIMAX_M2[i:i + piece])
                     for i in range(0, len(MINIMAX_M2), piece))
    rest, calls = reader.finish()
    assert passed + rest == "I will check both.\n" and "<" not in passed
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert msgspec.json.decode(calls[0].arguments) == {"city": "New York", "days": 3,
                                                       "hours": [9, 12]}
    assert calls[1].arguments == "{}"


@pytest.mark.parametrize("text", [
    MINIMAX_M2[MINIMAX_M2.index("<"):MINIMAX_M2.index("</parameter>")],  # cut short
    '<minimax:tool_call><invoke name="get_time">x</invoke> and more</minimax:tool_call>',
    '<minimax:tool_call><invoke name="get_time">x</invoke></minimax:tool_call>',
    '<minimax:tool_call><invoke name="">\n</invoke></minimax:tool_call>',
    "<minimax:tool_call>\n</minimax:tool_call>",
])
def test_what_is_no_minimax_m2_call_comes_back_as_text(text: str) -> None:
    reader = reader_for(FORMATS["minimax_m2"], "m", TOOLS)
    assert (reader.feed(text), reader.finish()) == ("", (text, []))


STEP3 = """I will check both.
<｜tool_calls_begin｜>
<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather">
<steptml:parameter name="city">New York</steptml:parameter>
<steptml:parameter name="days">3</steptml:parameter>
<steptml:parameter name="hours">[9, 12]</steptml:parameter>
</steptml:invoke><｜tool_call_end｜>
<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_time">
</steptml:invoke><｜tool_call_end｜>
<｜tool_calls_end｜>"""


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_step3s_steptml_invokes_read_as_minimax_m2s(piece: int) -> None:
    reader = reader_for(FORMATS["step3"], "m", TOOLS)
    passed = "".join(reader.feed(STEP3[i:i + piece]) for i in range(0, len(STEP3), piece))
    rest, calls = reader.finish()
    assert passed + rest == "I will check both.\n"
    assert [(c.name, msgspec.json.decode(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "hours": [9, 12]}), ("get_time", {})]
    assert format_of("... <steptml:invoke name=...", None, "m") is FORMATS["step3"]
    assert parse_step3(STEP3) is not None
    for no_call in (  # (read whole) not `function` and its separator; two invokes in a call
            STEP3.replace("function<｜tool_sep｜>", "", 1),
            STEP3.replace("</steptml:invoke><｜tool_call_end｜>\n<｜tool_call_begin｜>"
                          "function<｜tool_sep｜>", "</steptml:invoke>", 1)):
        assert parse_step3(no_call) is None


def test_a_call_cut_short_is_text_and_schemas_of_any_shape_are_read() -> None:
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert _read(cut, 5) == ("", cut, [])  # not a call with "Par" for a city
    unclosed = "<tool_call><function=get_weather><parameter=city>Paris</function>"
    assert _read(unclosed, 5)[2] == [ToolCall(name="get_weather",
                                              arguments='{"city":"Paris"}')]
    odd = [{"function": {"name": "a", "parameters": "none"}}, {"function": "b"}, {},
           {"function": {"name": "c", "parameters": {"properties": {"x": 1, "y": {
               "type": ["null", "integer"]}}}}}]
    assert parameter_types(odd) == {"a": {}, "c": {"y": "integer"}}
    untyped = ToolCallReader(FORMATS["qwen3_coder"], {"f"})  # no schemas: all text
    untyped.feed("<tool_call><function=f><parameter=n>1</parameter></function></tool_call>")
    assert untyped.finish()[1][0].arguments == '{"n":"1"}'


GLM = ("I'll check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York"
       "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
       "<tool_call>get_time</tool_call>")


@pytest.mark.parametrize("piece", [1, 6, 10_000])
def test_glm_calls_a_name_and_its_keys_and_values_typed_by_the_schema(piece: int) -> None:
    reader = reader_for(FORMATS["glm45"], "m", TOOLS)
    reader.feed(GLM)
    assert all(c.id.startswith("call_") for c in reader.finish()[1])
    passed, rest, calls = _read(GLM, piece, "glm45")
    assert passed + rest == "I'll check." and "<" not in passed
    assert [(c.name, msgspec.json.decode(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",  # cut short
    "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",  # a key without value
    "<tool_call>get_weather<arg_key></tool_call>",
    "<tool_call>get weather</tool_call>", "<tool_call></tool_call>",
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # hermes' JSON
    "<tool_call>rm_rf</tool_call><tool_call>get_time</tool_call>",  # not among the tools
])
def test_what_is_no_glm_call_comes_back_as_text(text: str) -> None:
    reader = reader_for(FORMATS["glm45"], "m", TOOLS)
    passed = "".join(reader.feed(text[i:i + 5]) for i in range(0, len(text), 5))
    rest, calls = reader.finish()
    assert passed + rest == text and calls == []


SEED_OSS = CALLS.replace("tool_call>", "seed:tool_call>")


@pytest.mark.parametrize("piece", [1, 8, 10_000])
def test_seed_oss_calls_are_qwen3_coders_in_tags_of_its_own(piece: int) -> None:
    passed, rest, calls = _read(SEED_OSS, piece, "seed_oss")
    assert passed + rest == "Let me look that up.\n" and "<" not in passed
    assert calls == _read(CALLS, piece)[2]
