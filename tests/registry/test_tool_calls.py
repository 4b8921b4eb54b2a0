"""Tool calls read out of a model's text, in its family's format (tool_choice "auto")."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import ToolCall
from modelpool.registry.loaders.tool_calls import (
    FORMATS,
    ToolCallReader,
    ToolFormat,
    format_of,
    kept_tokens,
    reader_for,
)
from modelpool.workers.capabilities.text_to_text import GenerationStats

HERMES = FORMATS["hermes"]
LLAMA3 = FORMATS["llama3_json"]
WEATHER = ToolCall(name="get_weather", arguments='{"city":"Paris"}')
TIME = ToolCall(name="get_time", arguments="{}")
NAMES = {"get_weather", "get_time", "f", "a"}  # the request's tools


def _read(tool_format: str, text: str, piece: int) -> tuple[list[str], str, list[ToolCall]]:
    """The text passed on after each piece of `piece` characters, what finish() gave
    back, and the calls."""
    reader = ToolCallReader(FORMATS[tool_format], NAMES)
    passed = [reader.feed(text[i:i + piece]) for i in range(0, len(text), piece)]
    rest, calls = reader.finish()
    assert len({c.id for c in calls}) == len(calls)  # each call an id of its own
    return passed, rest, [msgspec.structs.replace(c, id="") for c in calls]


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
    '<tool_call>\n{"name": "get_weather", "ar',  # cut short before its arguments began
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "a" "arguments": {}}\n</tool_call>',  # not JSON
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


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_mistral_calls_as_a_list_or_one_by_one_with_their_ids(piece: int) -> None:
    listed = ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]')
    passed, rest, calls = _read("mistral", listed, piece)
    assert "".join(passed) + rest == "Sure. " and calls == [WEATHER, TIME]
    one_by_one = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                  "[TOOL_CALLS]get_time[ARGS]{}")
    assert _read("mistral", one_by_one, piece)[2] == [WEATHER, TIME]
    for broken in ("[TOOL_CALLS] [1]", "[TOOL_CALLS]get_time[ARGS]", "[TOOL_CALLS]x"):
        assert _read("mistral", broken, piece)[1:] == (broken, [])
    cut = "[TOOL_CALLS]get_time[ARGS]{"  # streamed: it stands
    assert _read("mistral", cut, piece)[1:] == ("", [ToolCall(name="get_time", arguments="{")])
    reader = ToolCallReader(FORMATS["mistral"], NAMES)
    reader.feed(listed)
    ids = [c.id for c in reader.finish()[1]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)  # as its template insists
    hermes = ToolCallReader(HERMES, NAMES)
    hermes.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert hermes.finish()[1][0].id.startswith("call_")


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_pythonic_calls_are_a_list_of_keyword_calls_read_without_evaluating(
        piece: int) -> None:
    call = ' [get_weather(city="Paris"), get_time()]'
    passed, rest, calls = _read("pythonic", call, piece)
    assert passed == [""] * len(passed) and rest == "" and calls == [WEATHER, TIME]
    wrapped = "<|python_start|>[get_weather(city='Paris')]<|python_end|>"  # Llama 4's
    assert _read("pythonic", wrapped, piece)[2] == [WEATHER]
    values = "[f(a=-1.5, b=True, c=None, d=[1, 'x'], e={'k': {'n': 2}})]"
    assert _read("pythonic", values, piece)[2] == [ToolCall(
        name="f", arguments='{"a":-1.5,"b":true,"c":null,"d":[1,"x"],"e":{"k":{"n":2}}}')]
    text = "Paris is sunny. [get_weather(city='Paris')]"  # not at the start: text
    passed, rest, calls = _read("pythonic", text, piece)
    assert "".join(passed) == text and calls == []


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_olmo3s_calls_are_keyword_calls_a_line_each_after_any_text(piece: int) -> None:
    text = ("Checking.\n<function_calls>\n  get_weather(city='Paris')\n"
            "  f(a=true, b=false, c=null, d=[1, {\"k\": \"v\"}])\n</function_calls>")
    passed, rest, calls = _read("olmo3", text, piece)
    assert "".join(passed) == "Checking.\n" and rest == ""
    assert calls == [WEATHER, ToolCall(name="f", arguments='{"a":true,"b":false,"c":null,'
                                                           '"d":[1,{"k":"v"}]}')]
    for no_call in ("<function_calls>get_weather(city=Paris)</function_calls>",  # a name
                    "<function_calls>x = get_time()</function_calls>",
                    "<function_calls>get_weather('Paris')</function_calls>",
                    "<function_calls>Sure: get_time()</function_calls>",
                    "<function_calls></function_calls>"):
        passed, rest, calls = _read("olmo3", no_call, piece)
        assert "".join(passed) + rest == no_call and calls == []


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_longcats_calls_are_hermes_json_in_its_own_tags(piece: int) -> None:
    text = ('Sure. <longcat_tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</longcat_tool_call>')
    passed, rest, calls = _read("longcat", text, piece)
    assert "".join(passed) == "Sure. " and rest == "" and calls == [WEATHER]
    hermes = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert _read("longcat", hermes, piece)[2] == []  # another model's tags: text


@pytest.mark.parametrize("text", [
    "[1, 2]", "[see the docs](https://example.com)", "[get_weather('Paris')]",
    "[get_weather(city=paris)]", "[get_weather(city=__import__('os').getcwd())]",
    "[get_weather(**{'city': 'Paris'})]", "[os.system(command='ls')]",
    "[get_weather(city='Pa", "[rm_rf(path='/')]", "[" * 500 + "]" * 500,
    "[get_weather(city=['Paris')]", "[f(a=b'x')]", "[f(a={1, 2})]", "[f(a=1j)]",
    "[f(a={1: 2})]",
])
def test_what_is_no_pythonic_call_comes_back_as_text(text: str) -> None:
    passed, rest, calls = _read("pythonic", text, 3)
    assert "".join(passed) + rest == text and calls == []


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_granite_calls_are_a_json_list_after_its_marker(piece: int) -> None:
    text = (' <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]')
    passed, rest, calls = _read("granite", text, piece)
    assert "".join(passed) == "" and rest == "" and calls == [WEATHER, TIME]
    for text in ('<|tool_call|>{"name": "get_time"}', '<|tool_call|>[{"name": "get_ti',
                 "Sunny. <|tool_call|>[]", "<|tool_call|>[1]"):
        passed, rest, calls = _read("granite", text, piece)
        assert "".join(passed) + rest == text and calls == []


DEEPSEEK_V3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
               'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
               "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
               "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time'
                "<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_deepseek_calls_in_v3s_code_blocks_or_v31s_plain_json(piece: int) -> None:
    passed, rest, calls = _read("deepseek", DEEPSEEK_V3, piece)
    assert "".join(passed) + rest == "Let me check." and calls == [WEATHER, TIME]
    assert all("<" not in p for p in passed)
    assert _read("deepseek", DEEPSEEK_V31, piece)[1:] == ("", [WEATHER, TIME])
    for broken in ("<｜tool▁calls▁begin｜>get_time", "<｜tool▁calls▁begin｜><｜tool▁cal"
                   "l▁begin｜>get_time<｜tool▁sep｜>not json<｜tool▁call▁end｜>"):
        passed, rest, calls = _read("deepseek", broken, piece)
        assert "".join(passed) + rest == broken and calls == []
    cut = DEEPSEEK_V31[:DEEPSEEK_V31.index("{}")]  # the second call's arguments cut off
    no_separator = DEEPSEEK_V31.replace("get_time<｜tool▁sep｜>", "get_time")
    for streamed_first in (cut, no_separator):  # the first call was streamed: it stands
        assert _read("deepseek", streamed_first, piece)[1:] == ("", [WEATHER])


KIMI = ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>")


@pytest.mark.parametrize("piece", [1, 9, 1000])
def test_kimi_k2_calls_keep_the_ids_the_model_wrote(piece: int) -> None:
    reader = ToolCallReader(FORMATS["kimi_k2"], NAMES)
    passed = "".join(reader.feed(KIMI[i:i + piece]) for i in range(0, len(KIMI), piece))
    rest, calls = reader.finish()
    assert passed + rest == "Checking." and "<" not in passed
    assert calls == [msgspec.structs.replace(WEATHER, id="functions.get_weather:0"),
                     msgspec.structs.replace(TIME, id="functions.get_time:1")]
    cut = KIMI[:KIMI.index("{}")]
    for streamed_first in (cut, KIMI.replace("get_time:1", "get_time")):
        assert _read("kimi_k2", streamed_first, piece)[2] == [WEATHER]
    broken = KIMI.replace("functions.get_weather:0", "functions.get_weather")
    assert _read("kimi_k2", broken, piece)[2] == []


MINIMAX_M1 = ('Let me look.\n<tool_calls>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n{"name": "get_time", "arguments": {}}\n</tool_calls>')


@pytest.mark.parametrize("piece", [1, 6, 1000])
def test_minimax_m1_calls_are_a_json_object_a_line(piece: int) -> None:
    passed, rest, calls = _read("minimax", MINIMAX_M1, piece)
    assert "".join(passed) + rest == "Let me look.\n" and "<" not in "".join(passed)
    assert calls == [WEATHER, TIME]
    cut = MINIMAX_M1[:MINIMAX_M1.index('"name"')]  # cut short before its first call's name
    assert _read("minimax", cut, piece)[1:] == (cut[cut.index("<"):], [])
    assert _read("jamba", JAMBA, piece)[1:] == ("", [WEATHER, TIME])  # a list in the block
    assert FORMATS["jamba"] is FORMATS["hunyuan_a13b"] is FORMATS["minimax"]


JAMBA = (' <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {}}]</tool_calls>')


def test_the_format_comes_from_the_options_or_the_template() -> None:
    assert format_of("... <tool_call> ...", None, "m") is HERMES
    assert format_of("<|start_header_id|> ... parameters ...", None, "m") is LLAMA3
    assert format_of("<|python_tag|>", None, "m") is LLAMA3
    assert format_of("{{ '[TOOL_CALLS] [' }}", None, "m") is FORMATS["mistral"]
    pythonic = ("<|start_header_id|>system ... parameters ... 'Respond in the format "
                "[func_name1(params_name1=params_value1, ...), func_name2(params)] '")
    assert format_of(pythonic, None, "m") is FORMATS["pythonic"]  # though Llama 3's too
    assert format_of("{{ '<|tool_call|>' + tool_calls | tojson }}", None, "m") is FORMATS[
        "granite"]
    assert format_of("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", None, "m") is FORMATS[
        "deepseek"]
    qwen3_coder = ("<tool_call>\n<function=example_function_name>\n"
                   "<parameter=example_parameter_1>\nvalue_1\n</parameter>")
    assert format_of(qwen3_coder, None, "m") is FORMATS["qwen3_coder"]  # not hermes
    seed = qwen3_coder.replace("tool_call>", "seed:tool_call>")
    assert format_of(seed, None, "m") is FORMATS["seed_oss"]  # not Qwen3-Coder
    glm = "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>"
    assert format_of(glm, None, "m") is FORMATS["glm45"]  # not hermes either
    assert format_of("{{'<|tool_calls_section_begin|>'}}", None, "m") is FORMATS["kimi_k2"]
    internlm = "{{ '<|im_start|>environment name=<|plugin|>\\n' + message['content'] }}"
    assert format_of(internlm, None, "m") is FORMATS["internlm"] is FORMATS["internlm2"]
    minimax_m2 = '<minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="k">'
    assert format_of(minimax_m2, None, "m") is FORMATS["minimax_m2"]
    minimax_m1 = 'respond with <tool_calls></tool_calls> XML tags ... {"name": <tool-name>'
    assert format_of(minimax_m1, None, "m") is FORMATS["minimax"]
    olmo3 = ("Output any function calls within <function_calls></function_calls> XML tags."
             "{{- '<functions>' -}}{{- tools | tojson -}}")
    assert format_of(olmo3, None, "m") is FORMATS["olmo3"]
    longcat = "{{- '<longcat_tool_call>' + tool_call | tojson + '</longcat_tool_call>' }}"
    assert format_of(longcat, None, "m") is FORMATS["longcat"]
    llama31_custom = "<function=example_function_name>{...}</function> <|python_tag|>"
    assert format_of(llama31_custom, None, "m") is LLAMA3
    assert format_of("<|im_start|>{{ message.content }}", None, "m") is None
    assert format_of(None, None, "m") is None
    assert format_of(None, "llama3_json", "m") is LLAMA3
    vllms = {"deepseek_v3": "deepseek", "deepseek_v31": "deepseek", "qwen3_xml": "qwen3_coder",
             "llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "ernie45": "hermes",
             "jamba": "minimax", "hunyuan_a13b": "minimax", "internlm2": "internlm"}
    for name, same in vllms.items():  # vLLM's --tool-call-parser names for the same
        assert format_of("<tool_call>", name, "m") is FORMATS[same]
    with pytest.raises(ValueError, match="tool_call_format 'qwen' is not one of"):
        format_of("<tool_call>", "qwen", "m")


def test_a_model_whose_format_is_not_known_refuses_auto() -> None:
    with pytest.raises(PoolError, match="tool-call format is not known") as refused:
        reader_for(None, "m", TOOLS)
    assert refused.value.code is ErrorCode.BAD_REQUEST
    tools = [*TOOLS, {"type": "function", "function": {"name": "now"}}, {"odd": 1}]
    assert reader_for(HERMES, "m", tools).names == {"get_weather", "now"}


@pytest.mark.parametrize(("tool_format", "text"), [
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "Bob", "parameters": {"age": 3}}'),  # an answer in JSON
])
def test_a_call_to_a_function_not_among_the_tools_is_text(tool_format: str,
                                                          text: str) -> None:
    passed, rest, calls = _read(tool_format, text, 4)
    assert "".join(passed) + rest == text and calls == []


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


def test_a_formats_special_markers_are_kept_in_the_text_of_a_sequence_that_may_call(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding drops special tokens, so a format whose marker is one (Mistral's
    [TOOL_CALLS]) would lose it. The tiny tokenizer's <|im_start|> plays that marker:
    forced as the output by a logit bias, it is text when the request may call, and
    left out otherwise, one at a time and batched."""
    start = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    marked = ToolFormat("marked", "<|im_start|>", False, lambda text: None,
                        markers=("<|im_start|>", "<tool_call>", "nope"))
    assert kept_tokens(llm.tokenizer, marked.markers) == {start: "<|im_start|>"}  # special only
    assert kept_tokens(llm.tokenizer, HERMES.markers) == {}  # <tool_call> is text to it
    monkeypatch.setattr(llm, "tool_markers", {start: "<|im_start|>"})
    chat = [{"role": "user", "content": "hi"}]
    forced = {"logit_bias": {start: 100.0}, "max_tokens": 2, "temperature": 0}
    asks = [kinds.build("generate", chat, tools=TOOLS, tool_choice=choice, **forced)
            for choice in ("auto", "none")]
    alone = ["".join(llm.generate(r, GenerationStats())) for r in asks]
    assert alone == ["<|im_start|><|im_start|>", ""]
    decoder = llm.decoder()
    for i, request in enumerate(asks):
        decoder.add(i, llm.prepare(request))
    texts = ["", ""]
    while len(decoder):
        for event in decoder.step():
            texts[event.seq_id] += event.text
    assert texts == alone
