"""How the CLI prints a generated text's end: the tool calls the model made, one JSON
line each, plain and with --json."""

from __future__ import annotations

import json

import pytest

from modelpool.protocol.client_core import TextChunk
from modelpool.protocol.messages import ToolCall
from modelpool.supervisor import cli_ops

CALLS = [ToolCall(name="get_weather", arguments='{"city":"Paris"}'),
         ToolCall(name="now", arguments="{}")]


def test_a_texts_tool_calls_are_printed_after_it(capsys: pytest.CaptureFixture[str]) -> None:
    chunks = [TextChunk("Let me check."), TextChunk("", "tool_calls", 5, 9, tool_calls=CALLS)]
    cli_ops.print_text(chunks)
    out = capsys.readouterr()
    text, *calls = out.out.splitlines()
    assert text == "Let me check."
    assert [json.loads(c) for c in calls] == [
        {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"name": "now", "arguments": "{}"}]
    assert "[tool_calls: 5 prompt + 9 generated tokens]" in out.err
    cli_ops.print_text(chunks, as_json=True)
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert last["finish_reason"] == "tool_calls" and last["tool_calls"][1]["name"] == "now"
    assert "cached_tokens" not in last


def test_prompt_tokens_from_the_prefix_cache_are_counted_apart(
        capsys: pytest.CaptureFixture[str]) -> None:
    chunks = [TextChunk("Hi."), TextChunk("", "stop", 40, 3, cached_tokens=35)]
    cli_ops.print_text(chunks)
    assert "[stop: 40 prompt (35 cached) + 3 generated tokens]" in capsys.readouterr().err
    cli_ops.print_text(chunks, as_json=True)
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (last["prompt_tokens"], last["cached_tokens"]) == (40, 35)
