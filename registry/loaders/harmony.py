"""gpt-oss's output in OpenAI's harmony format: messages on channels, each

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the recipient may stand in the role's header instead: `<|start|>assistant
to=functions.get_weather<|channel|>commentary json<|message|>`). The analysis channel is
the model's thinking; the final channel, and a commentary without a recipient (a
preamble the user may see), its answer; a commentary to `functions.NAME` a call to that
function with the message as its arguments. A call to one of gpt-oss's built-in tools
(`browser.*`, `python`), which no request here offers, is kept with the thinking.
`<|return|>` and `<|call|>` end the output (the model's end-of-sequence tokens), so the
last message may end without a marker. Read as vLLM's harmony parsing reads it. A call to
one of the request's functions streams as it is written (tool_stream.py): its name once
its header is read, then its arguments' JSON text.
"""

from __future__ import annotations

import re

import msgspec

from modelpool.protocol.messages import CallDelta, ToolCall, new_call_id
from modelpool.registry.loaders.marks import partial_mark
from modelpool.registry.loaders.tool_stream import WHITE, JsonObject

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)
TEMPLATE_SIGNS = (CHANNEL, MESSAGE)  # what its chat template writes
FINAL = f"{CHANNEL}final{MESSAGE}"  # the answer's header: a structured output's start
FORMAT = "harmony"  # its name as a tool_call_format or reasoning_format option
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."
# A header is short; text this long without <|message|> is no harmony (an answer)
MAX_HEADER = 512


def used(template: str | None, tool_call_format: str | None,
         reasoning_format: str | None) -> bool:
    """Whether the model writes harmony: an option names it, or, where neither option is
    given, its template writes channels."""
    if FORMAT in (tool_call_format, reasoning_format) or tool_call_format == "openai" \
            or reasoning_format == "openai_gptoss":
        return True  # (vLLM's names for its parsers)
    unset = tool_call_format is None and reasoning_format is None
    return unset and all(sign in (template or "") for sign in TEMPLATE_SIGNS)


class HarmonyReader:
    """One output's messages as they stream: (thinking, answer) passed on as they come,
    each function call's arguments held until its message ends (`calls`)."""

    def __init__(self, reads_calls: bool = True) -> None:
        self.reads_calls = reads_calls  # False: a call's arguments are answer text
        self.pending = ""
        self.route: str | None = None  # None: reading a header; thinking, answer, call
        self.function = ""  # the call's function, while route is "call"
        self.arguments = ""
        self.calls: list[ToolCall] = []
        self.plain = False  # the output is not in harmony: all of it is answer
        # Streaming the calls to these functions (HarmonyCalls sets them), until one is not
        self.streams: set[str] | None = None
        self.deltas: list[CallDelta] = []
        self.call_id = ""  # the call being streamed: its id, its arguments sent so far
        self.sent = ""
        self.open: JsonObject | None = None  # its arguments' object, until it ends
        self.cut = False  # a streamed call ended before its arguments did
        self.streamed = 0  # calls streamed

    @property
    def thinking(self) -> bool:
        """Inside a message of the thinking (its header read, its end not)."""
        return self.route == "thinking"

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) that may be passed on now."""
        self.pending += text
        parts = {"thinking": "", "answer": ""}
        while self.pending:
            if self.plain:
                parts["answer"] += self.pending
                self.pending = ""
            elif self.route is None:
                if not self._header():
                    break
            elif not self._body(parts):
                break
        return parts["thinking"], parts["answer"]

    def _header(self) -> bool:
        """True once the message's header is read (its route set)."""
        at = self.pending.find(MESSAGE)
        if at < 0:
            head = self.pending.lstrip()
            looks = head.startswith(("<|", "assistant")) or any(
                m.startswith(head) for m in (*MARKERS, "assistant"))
            self.plain = len(self.pending) > MAX_HEADER or not looks
            return self.plain
        header, self.pending = self.pending[:at], self.pending[at + len(MESSAGE):]
        channel = CHANNEL_NAME.search(header)
        recipient = RECIPIENT.search(header)
        if recipient is not None and recipient[1].startswith(FUNCTIONS):
            self.function = recipient[1].removeprefix(FUNCTIONS)
            self.route = "call" if self.reads_calls else "answer"
        elif recipient is not None:
            self.route = "thinking"  # a built-in tool's call
        elif channel is not None and channel[1] == "analysis":
            self.route = "thinking"
        else:
            self.route = "answer"  # final, or a preamble on commentary
        return True

    def _body(self, parts: dict[str, str]) -> bool:
        """The body's text passed on (a call's held); True once the message ended."""
        found = [(at, end) for end in ENDS if (at := self.pending.find(end)) >= 0]
        if found:
            at, end = min(found)
            text, self.pending = self.pending[:at], self.pending[at + len(end):]
            self._take(parts, text)
            self._ended()
            return True
        cut = len(self.pending) - partial_mark(self.pending, ENDS)
        self._take(parts, self.pending[:cut])
        self.pending = self.pending[cut:]
        return False

    def _take(self, parts: dict[str, str], text: str) -> None:
        if self.route == "call":
            self.arguments += text
            if self.streams is not None:
                self._stream(text)
        else:
            parts[self.route or "answer"] += text

    def _stream(self, text: str) -> None:
        """A call's pieces: its name once its arguments begin as an object, then them."""
        if not self.call_id:
            body = self.arguments.lstrip(WHITE)
            if not body or self.streams is None:  # its arguments not begun: wait
                return
            if body[0] != "{" or self.function not in self.streams:
                self.streams = None  # this call and the rest come whole at the end
                return
            self.call_id, self.open, text = new_call_id(), JsonObject(), body
            self.deltas.append(CallDelta(index=len(self.calls), name=self.function,
                                         id=self.call_id))
        if self.open is not None:
            piece, took = self.open.feed(text)
            self.sent += piece
            if piece:
                self.deltas.append(CallDelta(index=len(self.calls), arguments=piece))
            if took is not None:
                self.open = None

    def take_deltas(self) -> list[CallDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas

    def _ended(self) -> None:
        if self.route == "call" and self.call_id:  # streamed: what was sent stands
            self.calls.append(ToolCall(name=self.function, arguments=self.sent,
                                       id=self.call_id))
            self.cut, self.streamed = self.open is not None, len(self.calls)
        elif self.route == "call":
            self.calls.append(ToolCall(name=self.function, arguments=_json_text(
                self.arguments), id=new_call_id()))
        self.call_id, self.sent, self.open = "", "", None
        self.route, self.function, self.arguments = None, "", ""
        self.pending = self.pending.lstrip().removeprefix(START)

    def finish(self) -> tuple[str, str]:
        """At the output's end: what is still held (a last message without its end)."""
        thinking, answer = self.feed("")
        if self.route is not None:
            parts = {"thinking": thinking, "answer": answer}
            self._take(parts, self.pending)
            self.pending = ""
            self._ended()
            return parts["thinking"], parts["answer"]
        rest, self.pending = self.pending, ""
        return thinking, answer + rest


def _json_text(arguments: str) -> str:
    """The arguments as compact JSON text, or as the model wrote them if they are not."""
    try:
        return msgspec.json.encode(msgspec.json.decode(arguments.strip())).decode()
    except msgspec.DecodeError:
        return arguments.strip()


class HarmonyCalls:
    """The tool reader of a harmony output: its answer passes as it is (calls are
    messages of their own, kept out of it by the HarmonyReader), its calls stream as they
    are written; at the end, the calls to the request's functions. A call to another is
    no call: its arguments are text, unless calls before it were streamed (they stand)."""

    def __init__(self, reader: HarmonyReader, names: set[str]) -> None:
        self.reader = reader
        self.names = names
        reader.streams = names

    def feed(self, text: str) -> str:
        return text

    def take_deltas(self) -> list[CallDelta]:
        return self.reader.take_deltas()

    @property
    def cut(self) -> bool:
        return self.reader.cut

    def finish(self) -> tuple[str, list[ToolCall]]:
        calls = self.reader.calls
        if any(c.name not in self.names for c in calls):
            if self.reader.streamed:  # the calls before the first to another
                return "", calls[:self.reader.streamed]
            return "".join(c.arguments for c in calls), []
        return "", calls
