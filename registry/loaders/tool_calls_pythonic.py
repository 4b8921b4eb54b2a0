"""The pythonic tool-call format (Llama 3.2 and 4 with their pythonic templates, ToolACE;
vLLM's `pythonic` and `llama4_pythonic`): the whole answer a Python list of calls with
keyword arguments, `[get_weather(city="Paris"), get_time()]`, maybe between Llama 4's
`<|python_start|>` and `<|python_end|>`. Read by Python's own parser with only literals
as values (strings, numbers, True/False/None, lists and dicts of them): nothing is
evaluated. Olmo 3's (vLLM's `olmo3`): such calls a line each (no list) in a
`<function_calls>` block after any text. Both take JSON's `true`, `false` and `null` as
values too (Olmo 3's template writes its calls' values as JSON). Streamed
(tool_stream.py) a call at a time, each once its parenthesis closes."""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import msgspec

from modelpool.protocol.messages import ToolCall

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# A call's start, from where the last one ended: the list's opening or a comma, its name
HEAD = re.compile(r"\s*(?:<\|python_start\|>)?\s*[\[,]\s*(?P<name>[A-Za-z_]\w*)\s*\(")
# What may still be a list of calls (else what is held is text): a name and "(" at most
LIST_BEGUN = re.compile(r"\s*(?:<\|python_start\|>)?\s*\[[\s(]*(?:[A-Za-z_]\w*\s*(?:\(.*)?)?",
                   re.DOTALL)
CLOSES = {")": "(", "]": "[", "}": "{"}
FUNCTION_CALLS = ("<function_calls>", "</function_calls>")  # Olmo 3's block
CALLS_BLOCK = re.compile(r"<function_calls>(.*?)(?:</function_calls>|$)", re.DOTALL)
# Olmo 3's call's start, from where the last one ended: its block's opening or a new line
LINE_HEAD = re.compile(r"\s*(?:<function_calls>)?\s*(?P<name>[A-Za-z_]\w*)\s*\(")
# What may still be calls, by format
BEGUN = {"pythonic": LIST_BEGUN, "olmo3": re.compile(
    r"\s*<function_calls>\s*(?:[A-Za-z_]\w*\s*(?:\(.*)?)?", re.DOTALL)}
JSON_NAMES = {"true": True, "false": False, "null": None}


def parse(text: str) -> list[ToolCall] | None:
    """The calls; None unless the text is one list of calls, each of literals only."""
    body = text.strip().removeprefix(PYTHON_START).strip().removesuffix(PYTHON_END)
    try:
        listed = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(listed, ast.List):
        return None
    calls = [_call(node) for node in listed.elts]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


def parse_lines(text: str) -> list[ToolCall] | None:
    """Olmo 3's calls, a line each in each block; None unless every line is one."""
    calls: list[ToolCall | None] = []
    for block in CALLS_BLOCK.findall(text):
        try:
            lines = ast.parse(textwrap.dedent(block).strip(), mode="exec").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        calls += [_call(line.value) if isinstance(line, ast.Expr) else None for line in lines]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Constant(JSON_NAMES[node.id]) if node.id in JSON_NAMES else node


def _call(node: ast.expr) -> ToolCall | None:
    if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
            or any(k.arg is None for k in node.keywords)):  # no positional, no **spread
        return None
    try:
        arguments = {k.arg: ast.literal_eval(_JsonNames().visit(k.value))
                     for k in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None  # a name or an expression
    if not _is_json(arguments):
        return None  # a value JSON has not (bytes, a set, a complex number)
    return ToolCall(name=node.func.id, arguments=msgspec.json.encode(arguments).decode())


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_is_json(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _is_json(v)
                                           for k, v in value.items())


class PythonCall:
    """One call's arguments, whole once its closing parenthesis is written (as JSON);
    ValueError where they do not read as literals."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.text = ""
        self.open = ["("]  # the brackets not closed yet
        self.quote = ""  # the string's quote, inside one
        self.escaped = False

    def feed(self, text: str) -> tuple[str, int | None]:
        for at, char in enumerate(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = ""
            elif char in "\"'":
                self.quote = char
            elif char in "([{":
                self.open.append(char)
            elif char in CLOSES:
                if self.open.pop() != CLOSES[char]:
                    raise ValueError("brackets that do not pair")
                if not self.open:
                    return self._arguments(self.text + text[:at + 1]), at + 1
        self.text += text
        return "", None

    def _arguments(self, text: str) -> str:
        try:
            node = ast.parse(f"{self.name}({text}", mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            node = None
        call = None if node is None else _call(node)
        if call is None:
            raise ValueError("not a call of literals")
        return call.arguments
