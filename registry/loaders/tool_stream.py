"""Tool calls streamed as the model writes them (tool_choice "auto"), as vLLM's parsers
stream them: a call's name (with its id) once its arguments begin, then their JSON text
piece by piece: where the model writes JSON (hermes, llama3_json, mistral, granite,
longcat, phi4_mini_json, xlam, internlm, deepseek, kimi_k2, minimax), its own text
without the white space between JSON's tokens (what a JSON encoder writes); where it
writes XML (qwen3_coder, seed_oss, glm45, minimax_m2, step3: tool_calls_xml.py), a
parameter at a time, typed as at the end; where it writes Python calls (pythonic, olmo3:
tool_calls_pythonic.py), a call at a time.

Each head pattern is matched where the last call's arguments ended, so no call is ever
skipped; what matches no head (another shape, arguments given as a string) is left to
the whole text's reading at the end, and its calls come whole then. A call naming no
tool (or a pythonic list no call can begin) makes it all text, which the reader then
passes on at once. Once a call has been streamed the answer is its calls: the whole
text's reading at the end confirms them (and gives any calls after them), or, where it
does not read as calls (the output cut short by max_tokens, a broken call after them),
what was streamed stands, as OpenAI sends a call cut short."""

from __future__ import annotations

import re
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Protocol

import msgspec

from modelpool.protocol.messages import CallDelta, ToolCall
from modelpool.registry.loaders import tool_calls_pythonic as pythonic
from modelpool.registry.loaders.tool_calls_xml import SHAPES, ParameterTypes, XmlArguments

WHITE = " \t\r\n"

# What comes before a call's arguments, from where the last call's ended (its object's
# closing brace, a separator, its block's end and the next one's opening), by format
_JSON = r'\}?\s*[,;]?\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"%s"\s*:\s*'
_LIST = r"(?:\s*%s\s*\[)?\s*" + _JSON % "arguments"  # a marker, then [{...}, {...}]
_tagged = r"\s*\}?\s*(?:</%s>\s*)?<%s>\s*"  # a block's end, the next one's opening
_DEEPSEEK = (r"(?:<｜tool▁calls▁begin｜>)?\s*(?:```)?\s*(?:<｜tool▁call▁end｜>)?\s*"
             r"<｜tool▁call▁begin｜>")
HEADS = {name: tuple(re.compile(head) for head in heads) for name, heads in {
    "hermes": (_tagged % ("tool_call", "tool_call") + _JSON % "arguments",),
    "minimax": (r"(?:<tool_calls>\s*\[?)?\s*" + _JSON % "arguments",),
    "llama3_json": (r"\s*(?:<\|python_tag\|>)?\s*" + _JSON % "(?:parameters|arguments)",),
    "mistral": (_LIST % re.escape("[TOOL_CALLS]"),
                r"\[TOOL_CALLS\]\s*(?P<name>[^\[\s]+?)\s*\[ARGS\]\s*"),
    "granite": (_LIST % re.escape("<|tool_call|>"),),
    "phi4_mini_json": (r"(?:functools\[)?\s*" + _JSON % "(?:arguments|parameters)",),
    "xlam": (_LIST % "(?:```(?:json)?)?",),
    "internlm": (r"\s*\}?\s*(?:<\|action_end\|>\s*)?<\|action_start\|>\s*<\|plugin\|>\s*"
                 + _JSON % "(?:parameters|arguments)",),
    "deepseek": (_DEEPSEEK + r"function<｜tool▁sep｜>(?P<name>[^\n<]+)\n```json\n",  # V3
                 _DEEPSEEK + r"(?P<name>[^\n<]+?)<｜tool▁sep｜>(?=\s*\{)"),  # V3.1
    "longcat": (_tagged % ("longcat_tool_call", "longcat_tool_call") + _JSON % "arguments",),
    "kimi_k2": (r"(?:<\|tool_calls_section_begin\|>)?\s*(?:<\|tool_call_end\|>)?\s*"
                r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+):\d+)"
                r"\s*<\|tool_call_argument_begin\|>\s*",),
}.items()} | {"pythonic": (pythonic.HEAD,), "olmo3": (pythonic.LINE_HEAD,)}
# The HTTP API's own shape for tool_choice "required": a list of {"name", "parameters"}
LISTED = "listed"
HEADS[LISTED] = (re.compile(r"\s*\[?\s*" + _JSON % "parameters"),)


class ArgumentsReader(Protocol):
    """One call's arguments as they are written: what `text` adds to their JSON text, and
    how much of it they took if they ended there; ValueError where they cannot be read."""

    def feed(self, text: str) -> tuple[str, int | None]: ...


class JsonObject:
    """One JSON object's text as it comes, white space between its tokens left out, and
    where it ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> tuple[str, int | None]:
        """The object's text in `text`, and the length of `text` it took if it ended
        there (None: it goes on)."""
        out = []
        for at, char in enumerate(text):
            if self.in_string:
                out.append(char)
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char not in WHITE:
                out.append(char)
                if char == '"':
                    self.in_string = True
                elif char in "{[":
                    self.depth += 1
                elif char in "}]":
                    self.depth -= 1
                    if self.depth <= 0:
                        return "".join(out), at + 1
        return "".join(out), None


@dataclass
class SentCall:
    name: str
    id: str
    arguments: str = ""
    ended: bool = False


def streams(tool_format: str) -> bool:
    return tool_format in HEADS or tool_format in SHAPES


class CallStream:
    """One output's calls streamed from its held text (from a call's opening on): each
    head pattern of its format matches from where the last call's arguments ended to
    where the next one's begin, naming the function (group `name`, and `id` where the
    model writes the call's id)."""

    def __init__(self, tool_format: str, names: Container[object], new_id: Callable[[], str],
                 types: ParameterTypes) -> None:
        self.xml = SHAPES.get(tool_format)
        self.heads = HEADS[tool_format] if self.xml is None else (self.xml.head,)
        self.begun = pythonic.BEGUN.get(tool_format)  # a Python format's: may still be calls
        self.pythonic = self.begun is not None
        self.names = names
        self.new_id = new_id
        self.types = types  # an XML format's parameters' JSON types, by function
        self.at = 0  # where in the held text reading goes on
        self.sent: list[SentCall] = []
        # the call being written (sent with its arguments' first piece) and their reader
        self.open: tuple[SentCall, ArgumentsReader] | None = None
        self.stopped = False  # something no head reads: the rest comes whole at the end
        self.refused = False  # what is held cannot read as calls (a call to no tool)
        self.deltas: list[CallDelta] = []

    def read(self, held: str) -> None:
        """Streams what the held text (all of it so far) adds."""
        while not self.stopped:
            if self.open is None and not self._head(held):
                self.refused |= self.begun is not None and not self.sent and \
                    self.begun.fullmatch(held) is None
                return
            assert self.open is not None
            call, arguments = self.open
            try:
                piece, took = arguments.feed(held[self.at:])
            except ValueError:
                self.stopped = True  # the rest comes whole at the end, if it reads so
                return
            if piece:
                self._send(call, piece)
            if took is None:
                self.at = len(held)
                return
            self.at += took
            call.ended, self.open = True, None

    def _send(self, call: SentCall, piece: str) -> None:
        """A piece of the call's arguments; its first names the call (not before: a
        call whose arguments never begin to read is not sent)."""
        if not self.sent or self.sent[-1] is not call:
            self.sent.append(call)
            self.deltas.append(CallDelta(index=len(self.sent) - 1, name=call.name, id=call.id,
                                         arguments=piece))
        else:
            self.deltas.append(CallDelta(index=len(self.sent) - 1, arguments=piece))
        call.arguments += piece

    def _head(self, held: str) -> bool:
        """Whether a call begins where reading goes on."""
        for head in self.heads:
            match = head.match(held, self.at)
            if match is None:
                continue
            name = match["name"].strip()
            if name not in self.names:
                self.refused = True
                break
            if self.xml is not None:
                arguments: ArgumentsReader = XmlArguments(self.xml, self.types.get(name, {}))
            elif self.pythonic:
                arguments = pythonic.PythonCall(name)
            else:
                body = held[match.end():].lstrip(WHITE)
                if not body:
                    return False  # its arguments not begun: wait
                if body[0] != "{":
                    break
                arguments = JsonObject()
            call = SentCall(name, match.groupdict().get("id") or self.new_id())
            self.at, self.open = match.end(), (call, arguments)
            return True
        else:
            return False
        self.stopped = True
        return False

    def take(self) -> list[CallDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas

    def settle(self, read: list[ToolCall] | None) -> tuple[list[ToolCall], bool]:
        """The answer's calls, given the whole text's reading (None: not calls), with the
        deltas that finish the streamed ones; True if what was streamed stands alone with
        a call's arguments cut short."""
        read = read or []
        if len(read) < len(self.sent) or not all(
                _agrees(s, r) for s, r in zip(self.sent, read, strict=False)):
            return [ToolCall(name=s.name, arguments=s.arguments, id=s.id)
                    for s in self.sent], not all(s.ended for s in self.sent)
        calls = []
        for index, (sent, call) in enumerate(zip(self.sent, read, strict=False)):
            rest = call.arguments.removeprefix(sent.arguments)
            if rest == call.arguments:
                rest = ""  # the same value written otherwise: what was streamed stands
            if rest:
                self.deltas.append(CallDelta(index=index, arguments=rest))
            calls.append(msgspec.structs.replace(call, id=sent.id,
                                                 arguments=sent.arguments + rest))
        return calls + read[len(self.sent):], False


def _agrees(sent: SentCall, call: ToolCall) -> bool:
    if sent.name != call.name:
        return False
    if call.arguments.startswith(sent.arguments):
        return True
    try:
        return sent.ended and bool(msgspec.json.decode(sent.arguments)
                                   == msgspec.json.decode(call.arguments))
    except msgspec.DecodeError:
        return False
