"""Tool calls streamed as the model writes them (tool_choice "auto"), as vLLM's parsers
stream them: a call's name (with its id) once its head is written, then its arguments'
JSON text piece by piece, each piece the model's own text without the white space
between JSON's tokens (what a JSON encoder writes).

A format streams where its calls' arguments are a JSON object after a head that names the
function (hermes, llama3_json, mistral, granite, deepseek, kimi_k2, minimax): each head
pattern is matched where the last call's arguments ended, so no call is ever skipped; what
matches no head (another shape, a call naming no tool, arguments given as a string) is
left to the whole text's reading at the end, and its calls come whole then. Once a call
has been streamed the answer is its calls: the whole text's reading at the end confirms
them (and gives any calls after them), or, where it does not read as calls (the output
cut short by max_tokens, a broken call after them), what was streamed stands, as OpenAI
sends a call cut short."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from modelpool.protocol.messages import CallDelta, ToolCall

WHITE = " \t\r\n"

# What comes before a call's arguments, from where the last call's ended (its object's
# closing brace, a separator, its block's end and the next one's opening), by format
_JSON = r'\}?\s*[,;]?\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]+)"\s*,\s*"%s"\s*:\s*'
_LIST = r"(?:\s*%s\s*\[)?\s*" + _JSON % "arguments"  # a marker, then [{...}, {...}]
_DEEPSEEK = (r"(?:<｜tool▁calls▁begin｜>)?\s*(?:```)?\s*(?:<｜tool▁call▁end｜>)?\s*"
             r"<｜tool▁call▁begin｜>")
HEADS = {name: tuple(re.compile(head) for head in heads) for name, heads in {
    "hermes": (r"\s*\}?\s*(?:</tool_call>\s*)?<tool_call>\s*" + _JSON % "arguments",),
    "minimax": (r"(?:<tool_calls>)?\s*" + _JSON % "arguments",),
    "llama3_json": (r"\s*(?:<\|python_tag\|>)?\s*" + _JSON % "(?:parameters|arguments)",),
    "mistral": (_LIST % re.escape("[TOOL_CALLS]"),
                r"\[TOOL_CALLS\]\s*(?P<name>[^\[\s]+?)\s*\[ARGS\]\s*"),
    "granite": (_LIST % re.escape("<|tool_call|>"),),
    "deepseek": (_DEEPSEEK + r"function<｜tool▁sep｜>(?P<name>[^\n<]+)\n```json\n",  # V3
                 _DEEPSEEK + r"(?P<name>[^\n<]+?)<｜tool▁sep｜>(?=\s*\{)"),  # V3.1
    "kimi_k2": (r"(?:<\|tool_calls_section_begin\|>)?\s*(?:<\|tool_call_end\|>)?\s*"
                r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+):\d+)"
                r"\s*<\|tool_call_argument_begin\|>\s*",),
}.items()}


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


class CallStream:
    """One output's calls streamed from its held text (from a call's opening on), for a
    format whose `heads` patterns each match from where the last call's arguments ended
    to where the next one's begin, naming the function (group `name`, and `id` where the
    model writes the call's id)."""

    def __init__(self, heads: tuple[re.Pattern[str], ...], names: set[object],
                 new_id: Callable[[], str]) -> None:
        self.heads = heads
        self.names = names
        self.new_id = new_id
        self.at = 0  # where in the held text reading goes on
        self.sent: list[SentCall] = []
        self.open: JsonObject | None = None  # the arguments being written
        self.stopped = False  # something no head reads: the rest comes whole at the end
        self.deltas: list[CallDelta] = []

    def read(self, held: str) -> None:
        """Streams what the held text (all of it so far) adds."""
        while not self.stopped:
            if self.open is None and not self._head(held):
                return
            assert self.open is not None
            piece, took = self.open.feed(held[self.at:])
            call = self.sent[-1]
            call.arguments += piece
            if piece:
                self.deltas.append(CallDelta(index=len(self.sent) - 1, arguments=piece))
            if took is None:
                self.at = len(held)
                return
            self.at += took
            call.ended, self.open = True, None

    def _head(self, held: str) -> bool:
        """Whether a call begins (its delta sent) where reading goes on."""
        for head in self.heads:
            match = head.match(held, self.at)
            if match is None:
                continue
            body = held[match.end():].lstrip(WHITE)
            if not body:
                return False  # its arguments not begun: wait
            if body[0] != "{" or match["name"] not in self.names:
                break
            call_id = match.groupdict().get("id") or self.new_id()
            self.sent.append(SentCall(match["name"], call_id))
            self.deltas.append(CallDelta(index=len(self.sent) - 1, name=match["name"],
                                         id=call_id))
            self.at, self.open = match.end(), JsonObject()
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
        deltas that finish the streamed ones; True if what was streamed stands alone
        (the calls cut short, or not read so)."""
        read = read or []
        if len(read) < len(self.sent) or not all(
                _agrees(s, r) for s, r in zip(self.sent, read, strict=False)):
            return [ToolCall(name=s.name, arguments=s.arguments, id=s.id)
                    for s in self.sent], True
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
