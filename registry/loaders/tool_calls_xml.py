"""Tool calls in XML, whose values are bare text: Qwen3-Coder's (Qwen3-Coder, Qwen3.5;
vLLM's `qwen3_coder` parser; Seed-OSS writes the same in `<seed:tool_call>` blocks,
vLLM's `seed_oss`), GLM's (GLM 4.5 and later; vLLM's `glm45`) and MiniMax M2's (vLLM's
`minimax_m2`):

    <tool_call>                 <tool_call>get_weather        <minimax:tool_call>
    <function=get_weather>      <arg_key>city</arg_key>       <invoke name="get_weather">
    <parameter=city>            <arg_value>Paris</arg_value>  <parameter name="city">Paris
    Paris                       </tool_call>                  </parameter>
    </parameter>                                              </invoke>
    </function>                                               </minimax:tool_call>
    </tool_call>

Step-3's (vLLM's `step3`) are MiniMax M2's invokes in the `steptml:` namespace, each
call between `<｜tool_call_begin｜>function<｜tool_sep｜>` and `<｜tool_call_end｜>`, all
between `<｜tool_calls_begin｜>` and `<｜tool_calls_end｜>`.

(In Qwen3-Coder's, a line break after a value's opening tag and before its closing one
is the format's, not the value's.) The call's tool gives each value its type: the JSON
schema's type of that parameter (`retype`), as vLLM does. A string-typed parameter,
or one the schema does not name, keeps its text; "null" is null whatever the type; a
value that does not read as its type keeps its text, for the client to judge.

Streamed (tool_stream.py), a call's arguments grow by a parameter at a time: each as its
closing tag is written, typed as at the end."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from modelpool.protocol.messages import ToolCall

BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
SEED_OPENS = "<seed:tool_call>"
SEED_BLOCK = re.compile(r"<seed:tool_call>(.*?)(?:</seed:tool_call>|$)", re.DOTALL)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>",
                          re.DOTALL)
GLM_TEMPLATE_SIGN = "<arg_key>"
FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)  # cut: no call
PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                       re.DOTALL)
MINIMAX_OPENS = "<minimax:tool_call>"  # its template shows the model this too
MINIMAX_BLOCK = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.DOTALL)
INVOKE = re.compile(r"<invoke name=([^>\n]*)>(.*?)</invoke>", re.DOTALL)
NAMED_PARAMETER = re.compile(r"<parameter name=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
STEP3_MARKERS = ("<｜tool_calls_begin｜>", "<｜tool_calls_end｜>", "<｜tool_call_begin｜>",
                 "<｜tool_sep｜>", "<｜tool_call_end｜>")
STEP3_CALL = re.compile(r"<｜tool_call_begin｜>\s*function\s*<｜tool_sep｜>(.*?)"
                        r"(?:<｜tool_call_end｜>|$)", re.DOTALL)
STEP3_INVOKE = re.compile(r"<steptml:invoke name=([^>\n]*)>(.*?)</steptml:invoke>", re.DOTALL)
STEP3_PARAMETER = re.compile(r"<steptml:parameter name=([^>\n]*)>(.*?)</steptml:parameter>",
                             re.DOTALL)
TEMPLATE_SIGNS = ("<function=", "<parameter=")  # what its chat template shows the model
BARE_OPENS = "<function="  # a Qwen3-Coder call without its <tool_call> around it
STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")
NUMBER_TYPES = ("num", "float", "double")

# A function's name -> its parameters' names -> their JSON schema types.
ParameterTypes = Mapping[str, Mapping[str, str]]


def parse(text: str, block_pattern: re.Pattern[str] = BLOCK) -> list[ToolCall] | None:
    """The calls, each parameter's value as text; None if a block holds no one whole
    function (one cut short by the length would be a call with a value cut short).
    Without `<tool_call>`, bare functions: None unless they are all the text is."""
    if text.startswith(BARE_OPENS):
        functions = FUNCTION.findall(text)
        if FUNCTION.sub("", text).strip():
            return None  # one cut short, or text after the calls
    else:
        blocks = [FUNCTION.findall(block) for block in block_pattern.findall(text)]
        if any(len(found) != 1 for found in blocks):
            return None
        functions = [found[0] for found in blocks]
    if not functions or any(not name.strip() for name, _ in functions):
        return None
    return [ToolCall(name=name.strip(), arguments=msgspec.json.encode(
        {key.strip(): _bare(value) for key, value in PARAMETER.findall(body)}).decode())
            for name, body in functions]



def parse_seed(text: str) -> list[ToolCall] | None:
    return parse(text, SEED_BLOCK)


def parse_glm(text: str) -> list[ToolCall] | None:
    """The calls, each value as text; None if a block is not a name and its arguments, or
    is cut short (no `</tool_call>`)."""
    calls = []
    for block in BLOCK.finditer(text):
        if not block[0].endswith("</tool_call>"):
            return None
        name, key, rest = block[1].partition("<arg_key>")
        name, arguments = name.strip(), key + rest
        if not name or any(c.isspace() or c == "<" for c in name) or \
                GLM_ARGUMENT.sub("", arguments).strip():
            return None
        calls.append(ToolCall(name=name, arguments=msgspec.json.encode(
            {key.strip(): value for key, value in GLM_ARGUMENT.findall(arguments)}).decode()))
    return calls or None


def parse_minimax(text: str) -> list[ToolCall] | None:
    """MiniMax M2's calls, each value as text; None if a block holds anything but whole
    invokes (one cut short, text beside them) or an invoke anything but parameters."""
    return _invoked(MINIMAX_BLOCK.findall(text), INVOKE, NAMED_PARAMETER)


def parse_step3(text: str) -> list[ToolCall] | None:
    """Step-3's calls, read as MiniMax M2's (one invoke a call)."""
    if len(found := STEP3_CALL.findall(text)) != text.count(STEP3_MARKERS[2]):
        return None  # a call that is not `function` and its separator
    calls = _invoked(found, STEP3_INVOKE, STEP3_PARAMETER)
    return calls if calls is not None and len(calls) == len(found) else None


def _invoked(blocks: list[str], invoke: re.Pattern[str],
             parameter: re.Pattern[str]) -> list[ToolCall] | None:
    calls = []
    for block in blocks:
        invokes = invoke.findall(block)
        if not invokes or invoke.sub("", block).strip():
            return None
        for name, body in invokes:
            if not _unquoted(name) or parameter.sub("", body).strip():
                return None
            arguments = {_unquoted(key): value.strip() for key, value in parameter.findall(body)}
            calls.append(ToolCall(name=_unquoted(name),
                                  arguments=msgspec.json.encode(arguments).decode()))
    return calls or None


def _unquoted(name: str) -> str:
    name = name.strip()
    return name[1:-1].strip() if len(name) > 1 and name[0] == name[-1] in "'\"" else name


def _bare(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


@dataclass(frozen=True)
class XmlShape:
    """A format's call as it streams: the head naming its function (group `name`), from
    where the last call ended; then parameters (groups `key`, `value`) up to its end."""

    head: re.Pattern[str]
    parameter: re.Pattern[str]
    closes: str  # a parameter's last tag: only text that holds it may complete one
    end: re.Pattern[str]
    value: Callable[[str], str]  # a value's text as the format means it


_NAMED = r"=\s*([\"']?)(?P<%s>[^>\n\"']+?)\%d\s*>"  # name="x", name=x


def _qwen3_coder(block: str) -> XmlShape:
    """Qwen3-Coder's calls, in blocks of this tag's."""
    return XmlShape(
        re.compile(rf"\s*(?:</{block}>\s*)?(?:<{block}>\s*)?<function=(?P<name>[^>\n]+)>"),
        re.compile(r"\s*<parameter=(?P<key>[^>\n]*)>(?P<value>.*?)</parameter>", re.DOTALL),
        "</parameter>", re.compile(r"\s*</function>"), _bare)


SHAPES = {
    "qwen3_coder": _qwen3_coder("tool_call"), "seed_oss": _qwen3_coder("seed:tool_call"),
    "glm45": XmlShape(
        re.compile(r"\s*(?:</tool_call>\s*)?<tool_call>\s*(?P<name>[^<\s]+)(?=\s|<)"),
        re.compile(r"\s*<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)"
                   r"</arg_value>", re.DOTALL),
        "</arg_value>", re.compile(r"\s*</tool_call>"), lambda value: value),
    "minimax_m2": XmlShape(
        re.compile(r"\s*(?:</minimax:tool_call>\s*)?(?:<minimax:tool_call>\s*)?<invoke name"
                   + _NAMED % ("name", 1)),
        re.compile(r"\s*<parameter name" + _NAMED % ("key", 1) + r"(?P<value>.*?)</parameter>",
                   re.DOTALL),
        "</parameter>", re.compile(r"\s*</invoke>"), str.strip),
    "step3": XmlShape(
        re.compile(r"\s*(?:</steptml:invoke>\s*)?(?:<｜tool_call_end｜>\s*)?"
                   r"(?:<｜tool_calls_begin｜>\s*)?<｜tool_call_begin｜>\s*function\s*"
                   r"<｜tool_sep｜>\s*<steptml:invoke name" + _NAMED % ("name", 1)),
        re.compile(r"\s*<steptml:parameter name" + _NAMED % ("key", 1)
                   + r"(?P<value>.*?)</steptml:parameter>", re.DOTALL),
        "</steptml:parameter>", re.compile(r"\s*</steptml:invoke>"), str.strip),
}


class XmlArguments:
    """One call's arguments as JSON text, a parameter at a time, and where they end."""

    def __init__(self, shape: XmlShape, types: Mapping[str, str]) -> None:
        self.shape = shape
        self.types = types
        self.body = ""
        self.at = 0  # where the next parameter (or the end) begins
        self.count = 0

    def feed(self, text: str) -> tuple[str, int | None]:
        """The arguments' text that `text` completes, and the length of `text` they
        took if they ended there (None: they go on)."""
        start = len(self.body)
        self.body += text
        out = []
        # a long value is matched once its closing tag is written, not at every piece
        look = max(self.at, start - len(self.shape.closes) + 1)
        while self.body.find(self.shape.closes, look) >= 0 and (
                found := self.shape.parameter.match(self.body, self.at)) is not None:
            key = found["key"].strip()
            value = _typed(self.shape.value(found["value"]), self.types.get(key, "string"))
            out.append(("," if self.count else "{") + msgspec.json.encode(key).decode() + ":"
                       + msgspec.json.encode(value).decode())
            self.at, self.count = found.end(), self.count + 1
            look = self.at
        end = self.shape.end.match(self.body, self.at)
        if end is None:
            return "".join(out), None
        return "".join(out) + ("}" if self.count else "{}"), end.end() - start


def retype(call: ToolCall, types: ParameterTypes) -> ToolCall:
    """The call with each parameter's text read as its schema's type."""
    known = types.get(call.name, {})
    arguments = msgspec.json.decode(call.arguments)
    typed = {key: _typed(value, known.get(key, "string")) for key, value in arguments.items()}
    return msgspec.structs.replace(call, arguments=msgspec.json.encode(typed).decode())


def _typed(text: str, json_type: str) -> Any:
    if text.strip().lower() == "null":
        return None
    if json_type in STRING_TYPES:
        return text
    if json_type.startswith(INTEGER_TYPES):
        return _read(text, int)
    if json_type.startswith(NUMBER_TYPES):
        number = _read(text, float)
        if not isinstance(number, float) or not math.isfinite(number):
            return text  # not a number, or one JSON has not (infinity)
        integral = _read(text, int)
        return integral if isinstance(integral, int) else number
    if json_type in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    try:  # an object, an array, or a type not given: JSON if it reads as JSON
        return msgspec.json.decode(text.strip())
    except msgspec.DecodeError:
        return text


def _read(text: str, as_type: type[int] | type[float]) -> Any:
    try:
        return as_type(text.strip())
    except ValueError:
        return text


def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The JSON schema type of each parameter of each function tool ("string" where it
    gives none; the first that is not "null" where it gives several)."""
    found: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found[function["name"]] = {
            name: _schema_type(schema) for name, schema in properties.items()
            if isinstance(schema, dict)} if isinstance(properties, dict) else {}
    return found


def _schema_type(schema: dict[str, Any]) -> str:
    given = schema.get("type", "string")
    if isinstance(given, list):
        given = next((t for t in given if t != "null"), "string")
    return str(given).strip().lower()
