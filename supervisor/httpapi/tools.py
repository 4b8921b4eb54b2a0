"""Function calling in a chat body, by structured output: `tools` go to the model's chat
template, and `tool_choice` "required" or a named function holds the output to a call,
as vLLM does for those two: the named function's arguments (its `parameters` schema),
or a list of calls to any of the tools (`[{"name", "parameters"}, ...]`). The answer's
`tool_calls` are made from that output; nothing model-specific is parsed. "auto" with
tools (the model decides, in its own format) is refused: reading each model family's
tool-call format is not done here. "none" shows the tools and answers in text."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec

from modelpool.protocol.client_core import TextChunk
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import TokenLogprob

NO_PARAMETERS = {"type": "object", "properties": {}}
AUTO_REFUSED = ("with tools, only \"required\" or a named function (the output held to a "
                "call); \"auto\" needs the model's own tool-call format, not read here")


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


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[Tool], msgspec.Meta(max_length=128)]


def bad(field: str, message: str) -> PoolError:
    return PoolError(ErrorCode.BAD_REQUEST, f"{field}: {message}")


class ToolCalls:
    """How one answer's output becomes tool calls, whole or streamed: a named function's
    arguments as they come, or a list of calls, sent once it is whole."""

    def __init__(self, named: str | None) -> None:
        self.named = named
        self.held: dict[int, tuple[str, list[TokenLogprob]]] = {}  # by choice: a list's

    def message(self, text: str) -> dict[str, Any]:
        """A whole answer's assistant message."""
        calls = self._calls(text)
        if calls is None:  # cut short (max_tokens): not a list of calls yet
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    def finish(self, reason: str | None) -> str | None:
        """OpenAI's: a forced function's call ends with stop, a list of calls with
        tool_calls."""
        return "tool_calls" if reason == "stop" and self.named is None else reason

    def delta(self, index: int, chunk: TextChunk, first: bool
              ) -> tuple[dict[str, Any], list[TokenLogprob] | None] | None:
        """A streamed chunk's delta and its tokens' logprobs; None while a list is held."""
        role = {"role": "assistant"} if first else {}
        if self.named is not None:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": chunk.text}}
            if first:
                call.update(id=_call_id(), type="function")
                call["function"]["name"] = self.named
            return {**role, "tool_calls": [call]}, chunk.logprobs
        text, entries = self.held.get(index, ("", []))
        text, entries = text + chunk.text, entries + list(chunk.logprobs or ())
        if chunk.finish_reason is None:
            self.held[index] = (text, entries)
            return None
        self.held.pop(index, None)
        message = self.message(text)
        message.pop("role")
        if "tool_calls" in message:
            message = {"tool_calls": [{"index": i, **c}
                                      for i, c in enumerate(message["tool_calls"])]}
        return {"role": "assistant", **message}, entries or None

    def _calls(self, text: str) -> list[dict[str, Any]] | None:
        if self.named is not None:
            return [_call(self.named, text)]
        try:
            listed = msgspec.json.decode(text)
        except msgspec.DecodeError:
            return None
        return [_call(c["name"], msgspec.json.encode(c["parameters"]).decode())
                for c in listed]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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
        raise bad("tool_choice", AUTO_REFUSED)
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
    return ToolCalls(None), {**shown, "json_schema": schema}
