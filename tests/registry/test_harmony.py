"""gpt-oss's harmony output read as it streams: its analysis channel the thinking, its
final channel (and preambles) the answer, its commentary to functions the calls."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from test_reasoning import Outbox

from modelpool.protocol import kinds
from modelpool.protocol.messages import CallDelta, Chunk, End, ToolCall
from modelpool.protocol.pipes import WorkItem
from modelpool.registry.loaders.harmony import HarmonyCalls, HarmonyReader, used
from modelpool.workers.capabilities import text_to_text

ANSWERED = ("<|channel|>analysis<|message|>The user greets. Reply <|politely|>.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
CALLED = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
          "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
          '<|message|>{"city": "Paris"}<|call|>'
          "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}")


def _read(text: str, piece: int, reads_calls: bool = True) -> tuple[str, str, HarmonyReader]:
    reader = HarmonyReader(reads_calls)
    read = [reader.feed(text[i:i + piece]) for i in range(0, len(text), piece)]
    read.append(reader.finish())
    return "".join(t for t, _ in read), "".join(a for _, a in read), reader


@pytest.mark.parametrize("piece", [1, 2, 5, 13, 10_000])
def test_channels_are_thinking_answer_and_calls_whatever_the_pieces(piece: int) -> None:
    thinking, answer, _ = _read(ANSWERED, piece)
    assert (thinking, answer) == ("The user greets. Reply <|politely|>.",
                                  "Hello! How can I help?")
    thinking, answer, reader = _read(CALLED, piece)
    assert (thinking, answer) == ("Need the weather.", "Checking both.")
    assert [(c.name, c.arguments) for c in reader.calls] == [
        ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
    assert len({c.id for c in reader.calls}) == 2


def test_the_answer_streams_as_it_comes() -> None:
    reader = HarmonyReader()
    assert reader.feed("<|channel|>fin") == ("", "")
    assert reader.feed("al<|message|>Hel") == ("", "Hel")
    assert reader.feed("lo <|") == ("", "lo ")  # may be an end
    assert reader.feed("b|> there") == ("", "<|b|> there")
    assert reader.finish() == ("", "")


def test_calls_to_the_requests_functions_only_and_built_in_tools_are_thinking() -> None:
    _, answer, reader = _read(CALLED, 7)
    assert HarmonyCalls(reader, {"get_weather", "get_time"}).finish()[1] == reader.calls
    text, calls = HarmonyCalls(reader, {"get_weather"}).finish()
    assert calls == [] and text == '{"city":"Paris"}{}'  # a call to no tool: text
    browsed = ("<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>"
               'analysis to=browser.search code<|message|>{"query": "x"}<|call|>')
    thinking, answer, reader = _read(browsed, 4)
    assert thinking == 'Search.{"query": "x"}' and answer == "" and reader.calls == []
    # tool_choice none: a call's arguments are answer text, not a call
    _, answer, reader = _read(CALLED, 3, reads_calls=False)
    assert answer == 'Checking both.{"city": "Paris"}{}' and reader.calls == []


def test_output_not_in_harmony_is_all_answer_and_a_cut_call_keeps_its_text() -> None:
    assert _read("Just text, no channels.", 4)[:2] == ("", "Just text, no channels.")
    assert _read("<|channel|>final" + "x" * 600, 50)[:2] == ("", "<|channel|>final" + "x" * 600)
    cut = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa'
    _, _, reader = _read(cut, 6)
    assert reader.calls == [ToolCall(name="get_weather", arguments='{"city": "Pa',
                                     id=reader.calls[0].id)]
    assert msgspec.json.decode(_read(CALLED, 9)[2].calls[0].arguments) == {"city": "Paris"}


def _streamed(text: str, piece: int, names: set[str]
              ) -> tuple[list[tuple[int, CallDelta]], HarmonyCalls]:
    """Each call piece with how much of the text had been fed when it came."""
    calls = HarmonyCalls(HarmonyReader(), names)
    pieces = []
    for at in range(0, len(text), piece):
        calls.reader.feed(text[at:at + piece])
        pieces += [(at + piece, d) for d in calls.take_deltas()]
    calls.reader.finish()
    return pieces + [(len(text), d) for d in calls.take_deltas()], calls


def _joined(pieces: list[CallDelta]) -> list[ToolCall]:
    joined: dict[int, ToolCall] = {}
    for p in pieces:
        was = joined.get(p.index, ToolCall(name=p.name, arguments="", id=p.id))
        joined[p.index] = msgspec.structs.replace(was, arguments=was.arguments + p.arguments)
    return list(joined.values())


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_calls_stream_as_they_are_written(piece: int) -> None:
    pieces, calls = _streamed(CALLED, piece, {"get_weather", "get_time"})
    text, made = calls.finish()
    assert text == "" and _joined([d for _, d in pieces]) == made and not calls.cut
    assert [(c.name, c.arguments) for c in made] == [("get_weather", '{"city":"Paris"}'),
                                                     ("get_time", "{}")]
    if piece == 1:  # the first call's pieces came before its end was written
        first = [at for at, d in pieces if d.index == 0]
        assert len(first) > 5 and first[-1] <= CALLED.index("<|call|>")
    cut = CALLED[:CALLED.index("Paris") + 2]  # max_tokens: what was streamed stands
    pieces, calls = _streamed(cut, piece, {"get_weather", "get_time"})
    assert calls.finish()[1] == _joined([d for _, d in pieces]) and calls.cut
    assert [c.arguments for c in calls.finish()[1]] == ['{"city":"Pa']
    pieces, calls = _streamed(CALLED, piece, {"get_time"})  # its first call to no tool
    assert pieces == [] and calls.finish() == ('{"city":"Paris"}{}', [])
    pieces, calls = _streamed(CALLED, piece, {"get_weather"})  # its second
    assert calls.finish() == ("", _joined([d for _, d in pieces]))
    assert [c.name for c in calls.finish()[1]] == ["get_weather"]


def test_a_template_that_writes_channels_is_harmony_unless_an_option_says_otherwise() -> None:
    template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert used(template, None, None) and not used("{{ messages }}", None, None)
    assert used("{{ messages }}", "harmony", None) and used(None, None, "harmony")
    assert used("{{ messages }}", "openai", None)  # vLLM's names for its parsers
    assert used("{{ messages }}", None, "openai_gptoss")
    assert not used(template, "hermes", None)  # an option names another format


def test_the_tiny_model_held_to_harmony_has_its_channels_read(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-llm, taken as gpt-oss, held by a regex to a thought, a preamble and two
    calls: the chunks carry the thinking, the preamble and the calls as they are
    written, the End the calls; without tool_choice auto, the calls' arguments are text."""
    monkeypatch.setattr(llm, "harmony", True)
    monkeypatch.setattr(llm, "structured_in_reasoning", True)  # the regex holds it all
    tools = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
    chat = [{"role": "user", "content": "weather?"}]
    for job_id, choice in enumerate(("auto", "none")):
        out = Outbox()
        request = kinds.build("generate", chat, tools=tools, tool_choice=choice,
                              regex=re.escape(CALLED), temperature=0)
        text_to_text.run(llm, [WorkItem(job_id=job_id, request=request)], out, 1)
        chunks = [m for m in out.sent if isinstance(m, Chunk)]
        end = out.sent[-1]
        assert isinstance(end, End)
        assert "".join(c.reasoning for c in chunks) == "Need the weather."
        thought = len(llm.tokenizer.encode("Need the weather.", add_special_tokens=False))
        assert thought <= end.reasoning_tokens < end.completion_tokens  # its message's
        if choice == "auto":
            assert "".join(c.text for c in chunks) == "Checking both."
            assert end.finish_reason == "tool_calls"
            assert [(c.name, c.arguments) for c in end.tool_calls or []] == [
                ("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]
            pieces = [d for c in chunks for d in c.calls or ()]
            assert len(pieces) > 4 and _joined(pieces) == end.tool_calls
        else:
            assert "".join(c.text for c in chunks) == 'Checking both.{"city": "Paris"}{}'
            assert end.tool_calls is None
