"""The JSON-written tool-call formats' readers and the text that marks them (tool_calls.py
says which model writes which, and how a model's is known): each reads the text from a
call's opening on into its calls, or None where it does not read as calls."""

from __future__ import annotations

import re
import secrets
import string
from typing import Any

import msgspec

from modelpool.protocol.messages import ToolCall

LONGCAT_MARKERS = ("<longcat_tool_call>", "</longcat_tool_call>")


def blocks(opens: str, closes: str) -> re.Pattern[str]:
    """Each block's text between its tags, the last maybe not closed (cut short)."""
    return re.compile(f"{re.escape(opens)}(.*?)(?:{re.escape(closes)}|$)", re.DOTALL)


HERMES_BLOCK = blocks("<tool_call>", "</tool_call>")
LONGCAT_BLOCK = blocks(*LONGCAT_MARKERS)
MINIMAX_M1_BLOCK = re.compile(r"<tool_calls>(.*?)(?:</tool_calls>|$)", re.DOTALL)
INTERNLM_MARKERS = ("<|action_start|>", "<|plugin|>", "<|action_end|>")
INTERNLM_BLOCK = re.compile(r"<\|action_start\|>(.*?)(?:<\|action_end\|>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
GRANITE_CALL = "<|tool_call|>"
PHI4_CALLS = "functools"
FENCE = "```"  # a Markdown code block's
DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")
DEEPSEEK_CALL = re.compile("<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)",
                           re.DOTALL)
KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(functions\.)?([^\s:<]+):(\d+)\s*"
                       r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)",
                       re.DOTALL)
DEEPSEEK_V3_CALL = re.compile(r"([^\n]*)\n```json\n(.*)\n```", re.DOTALL)  # name, arguments



def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else msgspec.json.encode(arguments).decode()
    return ToolCall(name=obj["name"], arguments=text)


def _each(listed: Any, arguments_key: str) -> list[ToolCall | None]:
    """A JSON list's calls (none: not a list)."""
    return [_call(c, arguments_key) for c in listed] if isinstance(listed, list) else []


def _all_or_none(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    return None if not calls or None in calls else calls  # type: ignore[return-value]


def _decoded(text: str) -> Any:
    try:
        return msgspec.json.decode(text.strip())
    except msgspec.DecodeError:
        return None


def _json_blocks(blocks: re.Pattern[str], text: str) -> list[ToolCall] | None:
    return _all_or_none([_call(_decoded(body), "arguments") for body in blocks.findall(text)])


def hermes(text: str) -> list[ToolCall] | None:
    return _json_blocks(HERMES_BLOCK, text)


def longcat(text: str) -> list[ToolCall] | None:
    """LongCat-Flash's: Hermes' JSON in its own tags."""
    return _json_blocks(LONGCAT_BLOCK, text)


def minimax_m1(text: str) -> list[ToolCall] | None:
    """MiniMax M1's: a JSON object a line, in each `<tool_calls>` block; Jamba's and
    Hunyuan-A13B's: a JSON list in it."""
    calls: list[ToolCall | None] = []
    for block in MINIMAX_M1_BLOCK.findall(text):
        listed = _decoded(block) if block.strip().startswith("[") else None
        calls += (_each(listed, "arguments") if isinstance(listed, list) else
                  [_call(_decoded(line), "arguments")
                   for line in block.splitlines() if line.strip()])
    return _all_or_none(calls)


def llama3_json(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix(PYTHON_TAG)
    whole = _decoded(text)
    objects = [whole] if whole is not None else [_decoded(p) for p in text.split(";")]
    return _all_or_none([_call(obj, "parameters") for obj in objects])


def mistral(text: str) -> list[ToolCall] | None:
    body = text.removeprefix(TOOL_CALLS).strip()
    if body.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
        return _all_or_none(_each(_decoded(body), "arguments"))
    calls = []  # name[ARGS]{...}, each after its own [TOOL_CALLS]
    for part in body.split(TOOL_CALLS):
        name, found, arguments = part.partition("[ARGS]")
        decoded = _decoded(arguments) if found else None
        calls.append(None if decoded is None else
                     _call({"name": name.strip(), "arguments": decoded}, "arguments"))
    return _all_or_none(calls)


def internlm(text: str) -> list[ToolCall] | None:
    """Each action a call, if it is to a plugin (not the code interpreter's)."""
    return _all_or_none([_call(_decoded(body.strip().removeprefix(INTERNLM_MARKERS[1])),
                               "parameters") if body.strip().startswith(INTERNLM_MARKERS[1])
                         else None for body in INTERNLM_BLOCK.findall(text)])


def phi4_mini(text: str) -> list[ToolCall] | None:
    return _all_or_none(_each(_decoded(text.removeprefix(PHI4_CALLS)), "parameters"))


def xlam(text: str) -> list[ToolCall] | None:
    body = text.strip().removeprefix(FENCE).removeprefix("json").removesuffix(FENCE)
    return _all_or_none(_each(_decoded(body), "arguments"))


def granite(text: str) -> list[ToolCall] | None:
    return _all_or_none(_each(_decoded(text.strip().removeprefix(GRANITE_CALL)), "arguments"))


def deepseek(text: str) -> list[ToolCall] | None:
    found = DEEPSEEK_CALL.findall(text)
    if len(found) != text.count(DEEPSEEK_MARKERS[2]):
        return None  # a call without its separator
    calls = []
    for head, rest in found:
        v3 = DEEPSEEK_V3_CALL.fullmatch(rest.strip())  # V3: head is the call's type
        name, arguments = (v3[1], v3[2]) if v3 else (head, rest)
        decoded = _decoded(arguments)
        calls.append(None if decoded is None else
                     _call({"name": name.strip(), "arguments": decoded}, "arguments"))
    return _all_or_none(calls)


def kimi_k2(text: str) -> list[ToolCall] | None:
    found = KIMI_CALL.findall(text)
    if len(found) != text.count(KIMI_MARKERS[2]):
        return None  # a call that is not an id and its arguments
    calls = []
    for prefix, name, index, arguments in found:
        decoded = _decoded(arguments)
        call = None if decoded is None else _call({"name": name, "arguments": decoded},
                                                  "arguments")
        calls.append(call and msgspec.structs.replace(call, id=f"{prefix}{name}:{index}"))
    return _all_or_none(calls)


def mistral_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
