"""Tool calls in a model's own words (tool_choice "auto"): the model decides whether to
call a tool and writes the call as its chat template taught it. Each family has its own
format; the ones read here, and how a model's is known:

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call,
  after any text (Qwen 2.5 and 3, Hermes, and the many templates that copy them). Known
  by its template naming `<tool_call>`.
- "llama3_json": the whole answer one `{"name": ..., "parameters": {...}}` object, or
  several joined by ";" (Llama 3.1 to 3.3), maybe after `<|python_tag|>`. Known by its
  template naming `<|python_tag|>`, or Llama 3's header tokens with "parameters".
- "mistral": `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (Mistral 7B
  v0.3, Nemo), or `[TOOL_CALLS]name[ARGS]{...}` a call (later Mistral templates). Known
  by its template naming `[TOOL_CALLS]`. Its call ids are 9 letters and digits (its
  template insists on them).
- "pythonic": the whole answer a Python list of calls with keyword arguments,
  `[get_weather(city="Paris"), get_time()]` (Llama 3.2 and Llama 4 with their pythonic
  templates, ToolACE), maybe between Llama 4's `<|python_start|>` and `<|python_end|>`.
  Known by its template's `[func_name1(` example. Read by Python's own parser, only
  literals as values, nothing evaluated (tool_calls_pythonic.py).
- "olmo3": Olmo 3's such calls, a line each (no list), in a `<function_calls>` block
  after any text, their values maybe JSON's `true`, `false` and `null`. Known by its
  template naming `<function_calls>`.
- "longcat": LongCat-Flash's, Hermes' JSON in `<longcat_tool_call>` blocks. Known by its
  template naming them.
- "granite": `<|tool_call|>` then a JSON list of `{"name", "arguments"}` at the answer's
  start (IBM Granite 3). Known by its template naming `<|tool_call|>`.
- "deepseek": DeepSeek V3's and R1's calls in `<｜tool▁calls▁begin｜>`, after any text,
  each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>` its name and its arguments in a json
  code block, or (V3.1) the name, the separator and the arguments, then
  `<｜tool▁call▁end｜>`. Known by its template naming `<｜tool▁calls▁begin｜>`.
- "qwen3_coder": Qwen3-Coder's XML, `<tool_call><function=name><parameter=key>value
  </parameter></function></tool_call>`, after any text (tool_calls_xml.py), each value
  given its type by the tool's schema; a bare `<function=...>` (no `<tool_call>`) is a
  call too, as vLLM reads it. Known by its template's `<function=` and
  `<parameter=` (ahead of hermes: the template names `<tool_call>` too). "seed_oss":
  Seed-OSS's, the same in `<seed:tool_call>` blocks, known by its template naming them.
- "glm45": GLM's `<tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value>
  </tool_call>`, after any text, each value typed as Qwen3-Coder's are. Known by its
  template's `<arg_key>` (ahead of hermes, too).
- "minimax": MiniMax M1's `<tool_calls>` block after any text, a JSON `{"name",
  "arguments"}` a line, or a JSON list of them (Jamba's and Hunyuan-A13B's; vLLM's
  `jamba` and `hunyuan_a13b`, names this format also answers to). Known by its
  template's `<tool_calls>`.
- "minimax_m2": MiniMax M2's `<minimax:tool_call>` block after any text, each `<invoke
  name="...">` a call with its `<parameter name="...">`s, typed as Qwen3-Coder's are
  (tool_calls_xml.py). Known by its template's `<minimax:tool_call>`.
- "kimi_k2": Kimi K2's calls between `<|tool_calls_section_begin|>` and its end, after
  any text, each `<|tool_call_begin|>` its id (`functions.name:index`, kept: its template
  writes it back), `<|tool_call_argument_begin|>`, its JSON arguments and
  `<|tool_call_end|>`. Known by its template naming `<|tool_calls_section_begin|>`.
- "step3": Step-3's steptml invokes (tool_calls_xml.py), typed as Qwen3-Coder's are.
- "internlm": InternLM 2.5's `<|action_start|><|plugin|>{"name", "parameters"}
  <|action_end|>` after any text (also `internlm2`). Known by its template's `<|plugin|>`.
- "phi4_mini_json": Phi-4-mini's `functools[{"name", "arguments"}, ...]`, after any text;
  "xlam": Salesforce xLAM's JSON list of `{"name", "arguments"}`, the whole answer, maybe
  in a ```json code block. Their templates do not show them: named by the option only.
The loader option `tool_call_format` names one where the template does not say. A
format's markers that the tokenizer holds as special tokens (`[TOOL_CALLS]`, some
Hermes tokenizers' `<tool_call>`) are kept in the text of a sequence that may call.
Text that starts like a call but does not read as one (not JSON, no tool's name) is
given back as text, as vLLM's parsers do, unless a call was streamed from it
(tool_stream.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import CallDelta, Describe, Generate, ToolCall, new_call_id
from modelpool.registry.loaders import tool_calls_json as js
from modelpool.registry.loaders import tool_calls_pythonic as pythonic
from modelpool.registry.loaders import tool_calls_xml
from modelpool.registry.loaders.marks import partial_mark
from modelpool.registry.loaders.tool_calls_xml import ParameterTypes, parameter_types
from modelpool.registry.loaders.tool_stream import CallStream, streams

PYTHONIC_EXAMPLE = "[func_name1("  # what the pythonic templates show their models


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opens: str  # the text a call begins with
    at_start: bool  # True: only the answer's start (after white space) opens calls
    parse: Callable[[str], list[ToolCall] | None]  # the text from `opens` on; None: no calls
    # at_start: what may come before `opens` (Llama's <|python_tag|>), longest first
    leads: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()  # its tokens the text must keep, if special
    new_id: Callable[[], str] = new_call_id
    # Arguments parsed as text, then given their types by the request's tools' schemas.
    retype: Callable[[ToolCall, ParameterTypes], ToolCall] | None = None
    also_opens: tuple[str, ...] = ()  # other texts a call may begin with (not at_start)


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", "<tool_call>", False, js.hermes,
               markers=("<tool_call>", "</tool_call>")),
    ToolFormat("llama3_json", '{"name"', True, js.llama3_json, leads=(js.PYTHON_TAG,),
               markers=(js.PYTHON_TAG,)),
    ToolFormat("mistral", js.TOOL_CALLS, False, js.mistral, markers=(js.TOOL_CALLS, "[ARGS]"),
               new_id=js.mistral_id),
    ToolFormat("pythonic", "[", True, pythonic.parse, leads=(pythonic.PYTHON_START,),
               markers=(pythonic.PYTHON_START, pythonic.PYTHON_END)),
    ToolFormat("olmo3", pythonic.FUNCTION_CALLS[0], False, pythonic.parse_lines,
               markers=pythonic.FUNCTION_CALLS),
    ToolFormat("longcat", js.LONGCAT_MARKERS[0], False, js.longcat, markers=js.LONGCAT_MARKERS),
    ToolFormat("granite", js.GRANITE_CALL, True, js.granite, markers=(js.GRANITE_CALL,)),
    ToolFormat("phi4_mini_json", js.PHI4_CALLS + "[", False, js.phi4_mini),
    ToolFormat("xlam", "[", True, js.xlam, leads=(js.FENCE + "json", js.FENCE)),
    ToolFormat("internlm", js.INTERNLM_MARKERS[0], False, js.internlm, markers=js.INTERNLM_MARKERS),
    ToolFormat("deepseek", js.DEEPSEEK_MARKERS[0], False, js.deepseek, markers=js.DEEPSEEK_MARKERS),
    ToolFormat("qwen3_coder", "<tool_call>", False, tool_calls_xml.parse,
               markers=("<tool_call>", "</tool_call>"), retype=tool_calls_xml.retype,
               also_opens=(tool_calls_xml.BARE_OPENS,)),
    ToolFormat("seed_oss", tool_calls_xml.SEED_OPENS, False, tool_calls_xml.parse_seed,
               markers=(tool_calls_xml.SEED_OPENS, "</seed:tool_call>"),
               retype=tool_calls_xml.retype),
    ToolFormat("glm45", "<tool_call>", False, tool_calls_xml.parse_glm,
               markers=("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                        "<arg_value>", "</arg_value>"), retype=tool_calls_xml.retype),
    ToolFormat("kimi_k2", js.KIMI_MARKERS[0], False, js.kimi_k2, markers=js.KIMI_MARKERS),
    ToolFormat("step3", tool_calls_xml.STEP3_MARKERS[0], False, tool_calls_xml.parse_step3,
               markers=tool_calls_xml.STEP3_MARKERS, retype=tool_calls_xml.retype),
    ToolFormat("minimax", "<tool_calls>", False, js.minimax_m1,
               markers=("<tool_calls>", "</tool_calls>")),
    ToolFormat("minimax_m2", tool_calls_xml.MINIMAX_OPENS, False, tool_calls_xml.parse_minimax,
               markers=(tool_calls_xml.MINIMAX_OPENS, "</minimax:tool_call>"),
               retype=tool_calls_xml.retype))}
# vLLM's names for these formats (its `--tool-call-parser`), read by the same readers
FORMATS |= {"jamba": FORMATS["minimax"], "hunyuan_a13b": FORMATS["minimax"],
            "internlm2": FORMATS["internlm"], "deepseek_v3": FORMATS["deepseek"],
            "deepseek_v31": FORMATS["deepseek"], "llama4_json": FORMATS["llama3_json"],
            "llama4_pythonic": FORMATS["pythonic"], "qwen3_xml": FORMATS["qwen3_coder"],
            "ernie45": FORMATS["hermes"]}


# What each format's template shows its model, looked for in this order (Seed-OSS's and
# GLM's templates show Qwen3-Coder's signs, and Qwen3-Coder's Hermes' `<tool_call>`)
TEMPLATE_SIGNS = (
    ((PYTHONIC_EXAMPLE,), "pythonic"), ((tool_calls_xml.SEED_OPENS,), "seed_oss"),
    (tool_calls_xml.TEMPLATE_SIGNS, "qwen3_coder"), ((tool_calls_xml.GLM_TEMPLATE_SIGN,), "glm45"),
    ((js.KIMI_MARKERS[0],), "kimi_k2"), ((js.LONGCAT_MARKERS[0],), "longcat"),
    ((pythonic.FUNCTION_CALLS[0],), "olmo3"), ((tool_calls_xml.MINIMAX_OPENS,), "minimax_m2"),
    (("<steptml:invoke",), "step3"),
    (("<tool_calls>",), "minimax"), ((js.GRANITE_CALL,), "granite"),
    ((js.INTERNLM_MARKERS[1],), "internlm"),
    ((js.DEEPSEEK_MARKERS[0],), "deepseek"), (("<tool_call>",), "hermes"),
    ((js.TOOL_CALLS,), "mistral"), ((js.PYTHON_TAG,), "llama3_json"),
    (("<|start_header_id|>", "parameters"), "llama3_json"))


def format_of(template: str | None, configured: str | None, key: str) -> ToolFormat | None:
    """The model's format: the one its options name, else the one its template shows."""
    if configured is not None:
        if configured not in FORMATS:
            raise ValueError(f"model {key!r}: tool_call_format {configured!r} is not one of "
                             f"{sorted(FORMATS)}")
        return FORMATS[configured]
    return next((FORMATS[name] for signs, name in TEMPLATE_SIGNS
                 if all(sign in (template or "") for sign in signs)), None)


def kept_tokens(tokenizer: Any, markers: tuple[str, ...]) -> dict[int, str]:
    """The markers (a format's) that are special tokens of this tokenizer, by id:
    decoding drops special tokens, and the reader needs these."""
    kept = {}
    for marker in markers:
        token = tokenizer.convert_tokens_to_ids(marker)
        if (isinstance(token, int) and tokenizer.convert_ids_to_tokens(token) == marker
                and tokenizer.decode([token], skip_special_tokens=True) == ""):
            kept[token] = marker
    return kept


def reader_for(tool_format: ToolFormat | None, key: str,
               tools: list[dict[str, Any]]) -> ToolCallReader:
    """A sequence's reader of calls to these tools (OpenAI's function tools); BAD_REQUEST
    when the model's format is not known."""
    if tool_format is None:
        raise PoolError(ErrorCode.BAD_REQUEST, f"tool_choice auto: model {key!r}'s tool-call "
                        f"format is not known (one of {sorted(FORMATS)}, from its chat "
                        "template or its tool_call_format option)")
    return ToolCallReader(tool_format, function_names(tools), parameter_types(tools))


def auto_reader(tool_format: ToolFormat | None, key: str,
                request: Generate | Describe) -> ToolCallReader | None:
    """What reads a request's calls out of its output when it lets the model call
    (tool_choice "auto"), else None."""
    if request.tool_choice != "auto":
        return None
    return reader_for(tool_format, key, request.tools)


def function_names(tools: list[dict[str, Any]]) -> set[Any]:
    """The names of a request's function tools (OpenAI's shape)."""
    functions = [t.get("function") for t in tools]
    return {f.get("name") for f in functions if isinstance(f, dict)}


class ToolCallReader:
    """One output's text, passed on until its calls begin, then held; at the end, the
    calls. Text that may be the start of a call is held until it is known not to be; calls
    that name a function not among `names` are no calls (Llama 3's format cannot tell an
    answer in JSON with a "name" from a call, and a client can run no other function)."""

    def __init__(self, tool_format: ToolFormat, names: set[Any],
                 types: ParameterTypes | None = None) -> None:
        self.format = tool_format
        self.names = names
        self.types = types or {}  # for a format whose arguments come as text
        self.pending = ""  # passed-on text held back: it may open a call
        self.held: str | None = None  # from the call's opening on
        self.stream = CallStream(tool_format.name, names, tool_format.new_id, self.types) \
            if streams(tool_format.name) else None
        self.cut = False  # the calls are what was streamed of them, one cut short
        # no call here (an at_start format's answer did not start with one, or what was
        # held cannot read as calls): the rest is text, passed on at once
        self.plain = False

    def feed(self, text: str) -> str:
        """The text that may be passed on now."""
        if self.plain:
            return text
        if self.held is not None:
            self.held += text
            passed = ""
        else:
            self.pending += text
            passed = self._at_start() if self.format.at_start else self._anywhere()
        if self.stream is not None and self.held is not None:
            self.stream.read(self.held)
            if self.stream.refused and not self.stream.sent:  # no need to hold it to the end
                passed, self.held, self.plain = passed + self.held, None, True
        return passed

    def take_deltas(self) -> list[CallDelta]:
        """The calls' pieces written since the last call (tool_stream.py)."""
        return [] if self.stream is None else self.stream.take()

    def _at_start(self) -> str:
        opens, start = self.format.opens, self.pending.lstrip()
        for lead in self.format.leads:
            if lead.startswith(start):
                return ""  # maybe a lead: wait for more
            if start.startswith(lead):
                start = start.removeprefix(lead).lstrip()
                break
        if start.startswith(opens):
            self.held, self.pending = self.pending, ""
        elif not opens.startswith(start):
            self.plain = True
            return self._pass(len(self.pending))
        return ""

    def _anywhere(self) -> str:
        openers = (self.format.opens, *self.format.also_opens)
        found = [at for at in (self.pending.find(opens) for opens in openers) if at >= 0]
        if found:
            at = min(found)
            text, self.held, self.pending = self.pending[:at], self.pending[at:], ""
            return text
        return self._pass(len(self.pending) - partial_mark(self.pending, openers))

    def _pass(self, length: int) -> str:
        text, self.pending = self.pending[:length], self.pending[length:]
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The text still held and the calls made (none: the held text was no call)."""
        text, self.pending = self.pending, ""
        if self.held is None:
            return text, []
        held, self.held = self.held, None
        calls = self._read(held)
        if self.stream is not None and self.stream.sent:
            calls, self.cut = self.stream.settle(calls)
            return text, calls
        return (text + held, []) if calls is None else (text, calls)

    def _read(self, held: str) -> list[ToolCall] | None:
        calls = self.format.parse(held)
        if calls is None or any(c.name not in self.names for c in calls):
            return None
        if self.format.retype is not None:
            calls = [self.format.retype(c, self.types) for c in calls]
        return [msgspec.structs.replace(c, id=c.id or self.format.new_id())
                for c in calls]  # an id the model wrote (Kimi K2's) is kept
