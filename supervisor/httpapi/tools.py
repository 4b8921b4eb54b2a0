"""Function calling in a chat body: `tools` go to the model's chat template. With
`tool_choice` "auto" (the default with tools) the model decides, and writes its calls in
its own format, which its worker reads (registry/loaders/tool_calls): they come back as
the pool's tool calls beside any text. "required" or a named function holds the output
to a call by structured output, as vLLM does for those two: the named function's
arguments (its `parameters` schema), or a list of calls to any of the tools (`[{"name",
"parameters"}, ...]`), made into `tool_calls` here, streamed as it is written (read as the
workers read the models' own formats: registry/loaders/tool_stream.py). "none" shows the
tools and answers in text."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from modelpool.protocol.client_core import TextChunk
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import CallDelta, TokenLogprob, ToolCall, new_call_id
from modelpool.registry.loaders.tool_stream import LISTED, CallStream

NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None  # the arguments always keep to the schema here


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant's message of the conversation, as an answer gave it."""

    type: Literal["function"] = "function"
    function: CalledFunction
    id: str = ""

    def for_pool(self) -> dict[str, str]:
        return {"name": self.function.name, "arguments": self.function.arguments,
                "id": self.id}


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], msgspec.Meta(max_length=128)]


def bad(field: str, message: str) -> PoolError:
    return PoolError(ErrorCode.BAD_REQUEST, f"{field}: {message}")


class ToolCalls:
    """How one answer's output becomes tool calls, whole or streamed: the calls the model
    made in its own format ("auto": its text and, in most formats, its calls streamed as
    they are written), a named function's arguments as they come, or a list of calls
    ("required"), each streamed as it is written."""

    def __init__(self, named: str | None, auto: bool = False, parallel: bool = True,
                 names: frozenset[str] = frozenset()) -> None:
        self.named = named
        self.auto = auto
        self.parallel = parallel  # False: an "auto" answer's first call only
        self.names = names  # the tools' (a list's calls name them)
        # By choice: a list's text, its tokens' logprobs not sent yet, its calls as they
        # stream, and its calls once whole (with the ids streamed)
        self.texts: dict[int, str] = {}
        self.unsent: dict[int, list[TokenLogprob]] = {}
        self.listing: dict[int, CallStream] = {}
        self.listed: dict[int, list[ToolCall]] = {}
        self.called: set[int] = set()  # the choices whose named call has begun
        self.streamed: dict[int, set[int]] = {}  # by choice: its "auto" calls streamed

    def message(self, text: str, made: list[ToolCall] | None = None,
                index: int = 0) -> dict[str, Any]:
        """A whole answer's assistant message (`made`: the calls the pool read, "auto";
        `index`: its choice's)."""
        if self.auto:
            if not made:
                return {"role": "assistant", "content": text}
            return {"role": "assistant", "content": text or None,
                    "tool_calls": openai_calls(self._kept(made))}
        calls = self._calls(text, index)
        if calls is None:  # cut short (max_tokens): not a list of calls yet
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def finish(self, reason: str | None) -> str | None:
        """OpenAI's: a forced function's call ends with stop, a list of calls with
        tool_calls (an "auto" answer's calls came with theirs)."""
        if self.auto or self.named is not None or reason != "stop":
            return reason
        return "tool_calls"

    def delta(self, index: int, chunk: TextChunk, first: bool
              ) -> tuple[dict[str, Any], list[TokenLogprob] | None] | None:
        """A streamed chunk's delta and its tokens' logprobs; None while nothing of a
        list's calls can be sent."""
        role = {"role": "assistant"} if first else {}
        if self.auto:
            delta: dict[str, Any] = {**role, "content": chunk.text}
            calls = self._auto_calls(index, chunk)
            if calls:
                delta["tool_calls"] = calls
            return delta, chunk.logprobs
        if self.named is not None:
            if not chunk.text:  # thinking, or the end: the call begins with its arguments
                return role, chunk.logprobs
            call: dict[str, Any] = {"index": 0, "function": {"arguments": chunk.text}}
            if index not in self.called:
                self.called.add(index)
                call.update(id=new_call_id(), type="function")
                call["function"]["name"] = self.named
            return {**role, "tool_calls": [call]}, chunk.logprobs
        entries = [*self.unsent.pop(index, []), *(chunk.logprobs or ())]
        pieces = self.list_pieces(index, chunk)
        if chunk.finish_reason is None and not pieces:
            self.unsent[index] = entries
            return None
        if pieces or index in self.listed:
            calls = self._pieces(index, pieces)
            return {**role, **({"tool_calls": calls} if calls else {})}, entries or None
        message = self.message(self.texts[index], index=index)
        message.pop("role")
        if "tool_calls" in message:
            message = {"tool_calls": [{"index": i, **c}
                                      for i, c in enumerate(message["tool_calls"])]}
        return {"role": "assistant", **message}, entries or None

    def list_pieces(self, index: int, chunk: TextChunk) -> list[CallDelta]:
        """A list of calls' pieces in a chunk, as the model writes them; at its end, what
        finishes them (its calls then in `listed`, if any was streamed)."""
        text = self.texts[index] = self.texts.get(index, "") + chunk.text
        if index not in self.listing:
            self.listing[index] = self._new_listing()
        listing = self.listing[index]
        listing.read(text)
        if chunk.finish_reason is not None and listing.sent:
            self.listed[index] = listing.settle(_listed(text))[0]
        return listing.take()

    def _auto_calls(self, index: int, chunk: TextChunk) -> list[dict[str, Any]]:
        """An "auto" answer's calls in a chunk: their pieces as the model writes them,
        and, with the last chunk, whole, the calls not streamed (read only at the end:
        a shape no head of their format reads, a custom loader's reader)."""
        whole = openai_calls(self._kept(chunk.tool_calls or []))
        out = self._pieces(index, chunk.calls or [])
        streamed = self.streamed[index]
        return out + [{"index": i, **call} for i, call in enumerate(whole)
                      if i not in streamed]

    def _pieces(self, index: int, pieces: list[CallDelta]) -> list[dict[str, Any]]:
        """Calls' pieces as OpenAI streams them: a call's first with its id and name."""
        streamed = self.streamed.setdefault(index, set())
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if piece.index > 0 and not self.parallel:
                continue
            function = {"arguments": piece.arguments}
            if piece.index not in streamed:
                streamed.add(piece.index)
                out.append({"index": piece.index, "id": piece.id, "type": "function",
                            "function": {"name": piece.name, **function}})
            else:
                out.append({"index": piece.index, "function": function})
        return out

    def _new_listing(self) -> CallStream:
        return CallStream(LISTED, self.names, new_call_id, {})

    def _kept(self, made: list[ToolCall]) -> list[ToolCall]:
        return made if self.parallel else made[:1]

    def _calls(self, text: str, index: int) -> list[dict[str, Any]] | None:
        if self.named is not None:
            return [_call(self.named, text)]
        if index in self.listed:  # streamed: as it was
            return openai_calls(self.listed[index])
        read = _listed(text)
        if read is None:
            return None
        listing = self._new_listing()
        listing.read(text)  # the arguments as a stream of it would send them
        return openai_calls(listing.settle(read)[0] if listing.sent else read)


def openai_calls(made: list[ToolCall]) -> list[dict[str, Any]]:
    """The pool's tool calls as OpenAI's, each with its id (the model's format's shape)
    or one made here."""
    return [_call(c.name, c.arguments, c.id) for c in made]


def _listed(text: str) -> list[ToolCall] | None:
    """A list of calls' text read whole (None: not one, cut short)."""
    try:
        listed = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    return [ToolCall(name=c["name"], arguments=msgspec.json.encode(c["parameters"]).decode(),
                     id=new_call_id()) for c in listed]


def _call(name: str, arguments: str, call_id: str = "") -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}



def tool_calls(tools: list[Tool] | None, choice: ToolChoice | None,
               parallel: bool | None) -> tuple[ToolCalls | None, dict[str, Any]]:
    """What a body's tools ask: how its output becomes calls (None: text), and the pool
    call's arguments for them (the tools for the template, the schema of a call)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "names a tool choice but the body has no tools")
        return None, {}
    shown = {"tools": [msgspec.to_builtins(t) for t in tools]}
    if choice == "none":
        return None, shown
    if choice in (None, "auto"):
        return ToolCalls(None, auto=True, parallel=parallel is not False), {
            **shown, "tool_choice": "auto"}
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise bad("tool_choice", f"names {choice.function.name!r}, not one of the tools")
        schema = named[0].function.parameters or NO_PARAMETERS
        return ToolCalls(choice.function.name), {**shown, "json_schema": schema}
    one_of = [{"type": "object", "additionalProperties": False,
               "required": ["name", "parameters"],
               "properties": {"name": {"const": t.function.name},
                              "parameters": t.function.parameters or NO_PARAMETERS}}
              for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if parallel is False:
        schema["maxItems"] = 1
    names = frozenset(t.function.name for t in tools)
    return ToolCalls(None, names=names), {**shown, "json_schema": schema}
