"""The text_to_text adapter: stop strings, chunk sequencing, aborts and errors, with a fake
model and a fake outbox (no torch, no processes)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Chunk, End, Error, Generate, TokenLogprob, ToolCall
from modelpool.protocol.pipes import WorkItem
from modelpool.registry.loaders.tool_calls import FORMATS, ToolCallReader
from modelpool.workers.capabilities import text_to_text
from modelpool.workers.capabilities.text_to_text import GenerationStats, StopMatcher


class FakeOutbox:
    """Records replies and ticks; aborted() turns True from its abort_on-th call on."""

    def __init__(self, abort_on: int | None = None) -> None:
        self.sent: list[msgspec.Struct] = []
        self.ticks = 0
        self.tokens = 0
        self.abort_calls = 0
        self.abort_on = abort_on

    def send(self, msg: msgspec.Struct) -> None:
        self.sent.append(msg)

    def tick(self, tokens: int = 0) -> None:
        self.ticks += 1
        self.tokens += tokens

    def aborted(self, job_id: int) -> bool:
        self.abort_calls += 1
        return self.abort_on is not None and self.abort_calls >= self.abort_on

    def chunks(self) -> list[Chunk]:
        return [m for m in self.sent if isinstance(m, Chunk)]


class FakeModel:
    """Yields the given pieces, one token each; raises `fail` after them if given."""

    def __init__(self, pieces: list[str], fail: Exception | None = None,
                 finish_reason: str = "stop") -> None:
        self.pieces = pieces
        self.fail = fail
        self.finish_reason = finish_reason
        self.pulled = 0

    def generate(self, request: Generate, stats: GenerationStats) -> Iterator[str]:
        stats.prompt_tokens = len(request.prompt.split())
        for piece in self.pieces:
            stats.completion_tokens += 1
            self.pulled += 1
            yield piece
        if self.fail is not None:
            raise self.fail
        stats.finish_reason = self.finish_reason

    def info(self) -> dict[str, int]:
        return {"context": 64}


def _run(model: FakeModel, out: FakeOutbox, job_id: int = 9, **fields: object) -> None:
    request = kinds.build("generate", "three word prompt", **fields)
    text_to_text.run(model, [WorkItem(job_id=job_id, request=request)], out, 1)


# ---- StopMatcher -----------------------------------------------------------------------


def _feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    emitted: list[str] = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        emitted.append(text)
        if hit:
            return emitted, True
    return emitted, False


def test_stop_split_across_pieces_is_cut_and_never_emitted() -> None:
    matcher = StopMatcher(["<END>"])
    emitted, hit = _feed_all(matcher, ["Hello wor", "ld<E", "N", "D> tail"])
    assert hit
    assert "".join(emitted) == "Hello world"
    assert not any("<" in e for e in emitted)


def test_holdback_releases_text_that_was_not_a_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abcST") == ("ab", False)  # "cST" could still start "STOP"
    assert matcher.feed("ART") == ("cST", False)
    assert matcher.flush() == "ART"
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(["\n\n", "###"])
    emitted, hit = _feed_all(matcher, ["one ##", "# two\n\nthree"])
    assert hit and "".join(emitted) == "one "


def test_no_stop_string_ends_the_first_min_tokens_pieces() -> None:
    matcher = StopMatcher(["STOP"], min_tokens=2)
    emitted, hit = _feed_all(matcher, ["aSTOP", "b", "cSTOP", "d"])
    assert hit and "".join(emitted) == "aSTOPbc"  # the first STOP came in piece 1 of 2


def test_empty_stop_list_passes_everything_through() -> None:
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        assert matcher.feed("a") == ("a", False)
        assert matcher.feed("bc") == ("bc", False)
        assert matcher.flush() == ""


# ---- the adapter -----------------------------------------------------------------------


def test_chunks_are_sequenced_and_end_carries_the_stats() -> None:
    out = FakeOutbox()
    _run(FakeModel(["Hel", "lo", " world", "!"]), out)
    chunks = out.chunks()
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert all(c.id == 9 for c in chunks)
    assert "".join(c.text for c in chunks) == "Hello world!"
    assert out.sent[-1] == End(id=9, finish_reason="stop", prompt_tokens=3, completion_tokens=4)
    assert out.ticks == 4


def test_length_finish_reason_is_passed_on() -> None:
    out = FakeOutbox()
    _run(FakeModel(["a", "b"], finish_reason="length"), out)
    assert out.sent[-1] == End(id=9, finish_reason="length", prompt_tokens=3, completion_tokens=2)


def test_stop_string_ends_the_stream_with_stop() -> None:
    model = FakeModel(["The answer", " is 42.\nQ", "uestion: more", " and more", " and more"])
    out = FakeOutbox()
    _run(model, out, stop=["\nQuestion:"])
    chunks = out.chunks()
    assert "".join(c.text for c in chunks) == "The answer is 42."
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    end = out.sent[-1]
    assert isinstance(end, End) and end.finish_reason == "stop"
    assert model.pulled == 3  # generation stopped right at the stop string
    assert sum(isinstance(m, End) for m in out.sent) == 1


class LogprobModel(FakeModel):
    """Gives each piece's token an entry when the request asks for logprobs."""

    def generate(self, request: Generate, stats: GenerationStats) -> Iterator[str]:
        for i, piece in enumerate(super().generate(request, stats)):
            if request.sampling.logprobs is not None:
                stats.logprob = TokenLogprob(piece, i, -float(i))
            yield piece


def test_each_tokens_logprob_goes_once_with_the_chunk_after_it() -> None:
    """Text held back for a stop string, then cut by it: every token's entry still goes,
    in order, in a chunk of its own step (text "" while its text is held back)."""
    pieces = ["The answer", "", " is 42.\nQ", "uestion: more", " and more"]
    out = FakeOutbox()
    _run(LogprobModel(pieces), out, stop=["\nQuestion:"], logprobs=0)
    chunks = out.chunks()
    assert [c.text for c in chunks] == ["T", "", "he answer", " is 42."]
    assert [[e.token for e in c.logprobs or []] for c in chunks] == [[p] for p in pieces[:4]]
    assert [c.seq for c in chunks] == [0, 1, 2, 3]
    out = FakeOutbox()
    _run(LogprobModel(pieces), out)  # not asked: none, and no empty chunk
    assert all(c.logprobs is None and c.text for c in out.chunks())


def test_held_back_text_is_flushed_at_the_end() -> None:
    out = FakeOutbox()
    _run(FakeModel(["done", " ST"]), out, stop=["STOP"])
    assert "".join(c.text for c in out.chunks()) == "done ST"
    assert isinstance(out.sent[-1], End)


def test_abort_ends_with_cancelled() -> None:
    model = FakeModel([f"w{i} " for i in range(10)])
    out = FakeOutbox(abort_on=3)
    _run(model, out)
    assert [c.text for c in out.chunks()] == ["w0 ", "w1 "]
    end = out.sent[-1]
    assert isinstance(end, End) and end.finish_reason == "cancelled"
    assert model.pulled == 3


def test_model_exception_mid_stream_is_a_model_error_without_end() -> None:
    out = FakeOutbox()
    _run(FakeModel(["partial ", "text"], fail=ValueError("tensor blew up")), out)
    assert [c.text for c in out.chunks()] == ["partial ", "text"]
    errors = [m for m in out.sent if isinstance(m, Error)]
    assert len(errors) == 1 and out.sent[-1] is errors[0]
    assert errors[0].id == 9 and errors[0].code == ErrorCode.MODEL_ERROR
    assert "ValueError" in errors[0].message and "tensor blew up" in errors[0].message
    assert not any(isinstance(m, End) for m in out.sent)


def test_pool_error_keeps_its_code() -> None:
    out = FakeOutbox()
    _run(FakeModel([], fail=PoolError(ErrorCode.BAD_REQUEST, "prompt too long")), out)
    assert out.sent == [Error(id=9, code=ErrorCode.BAD_REQUEST, message="prompt too long")]


@pytest.mark.parametrize("abort_on", [None, 2])
def test_each_item_gets_exactly_one_final_reply(abort_on: int | None) -> None:
    out = FakeOutbox(abort_on=abort_on)
    items = [WorkItem(job_id=j, request=Generate(id=j, prompt="p")) for j in (1, 2)]
    text_to_text.run(FakeModel(["x", "y", "z"]), items, out, 1)
    finals = [m for m in out.sent if isinstance(m, End | Error)]
    assert [m.id for m in finals] == [1, 2]


class ContextModel(FakeModel):
    def info(self) -> dict[str, int]:
        return {"context": 16}


def test_a_prompt_that_cannot_fit_the_context_is_refused_before_tokenizing() -> None:
    model, out = ContextModel(["never"]), FakeOutbox()
    request = Generate(id=1, prompt="x" * 8_000_000)
    text_to_text.run(model, [WorkItem(job_id=5, request=request)], out, 1)
    assert model.pulled == 0
    assert len(out.sent) == 1 and isinstance(out.sent[0], Error)
    assert out.sent[0].code is ErrorCode.BAD_REQUEST and "context" in out.sent[0].message


# ---- tool calls (tool_choice "auto") -----------------------------------------------------

CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
WEATHER = ToolCall(name="get_weather", arguments='{"city":"Paris"}')


def _chat(**fields: object) -> Generate:
    return kinds.build("generate", [{"role": "user", "content": "weather?"}], tools=TOOLS,
                       **fields)


def test_the_models_calls_end_its_stream_and_its_text_is_streamed_before(llm: Any) -> None:
    """The tiny model held to a call by a regex: what a model that chose to call writes."""
    out = FakeOutbox()
    request = _chat(tool_choice="auto", regex=re.escape("Let me check.\n" + CALL),
                    temperature=0)
    text_to_text.run(llm, [WorkItem(job_id=3, request=request)], out, 1)
    assert "".join(c.text for c in out.chunks()) == "Let me check.\n"
    end = out.sent[-1]
    assert isinstance(end, End) and end.finish_reason == "tool_calls"
    (call,) = end.tool_calls or []
    assert call.id.startswith("call_") and end.completion_tokens > 10
    assert msgspec.structs.replace(call, id="") == WEATHER

    out = FakeOutbox()  # tool_choice "none": the same output is text
    request = _chat(regex=re.escape("Let me check.\n" + CALL), temperature=0)
    text_to_text.run(llm, [WorkItem(job_id=4, request=request)], out, 1)
    assert "".join(c.text for c in out.chunks()) == "Let me check.\n" + CALL
    assert out.sent[-1] == msgspec.structs.replace(end, id=4, finish_reason="stop",
                                                   tool_calls=None)


def test_a_model_writing_pythonic_calls_has_them_read(llm: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model, its format taken as Llama 3.2's pythonic one, held by a regex to
    a list of two calls: both are read, and nothing of them streams as text."""
    monkeypatch.setattr(llm, "tool_format", FORMATS["pythonic"])
    out = FakeOutbox()
    written = "[get_weather(city='Paris'), get_weather(city=\"Oslo\")]"
    request = _chat(tool_choice="auto", regex=re.escape(written), temperature=0)
    text_to_text.run(llm, [WorkItem(job_id=6, request=request)], out, 1)
    assert "".join(c.text for c in out.chunks()) == ""
    end = out.sent[-1]
    assert isinstance(end, End) and end.finish_reason == "tool_calls"
    assert [msgspec.structs.replace(c, id="") for c in end.tool_calls or []] == [
        WEATHER, ToolCall(name="get_weather", arguments='{"city":"Oslo"}')]


def test_a_model_writing_deepseek_calls_after_text_has_them_read(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model, its format taken as DeepSeek's, held by a regex to a sentence and
    a call in V3's form: the sentence streams, the call is read."""
    monkeypatch.setattr(llm, "tool_format", FORMATS["deepseek"])
    out = FakeOutbox()
    written = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
               'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
               "<｜tool▁calls▁end｜>")
    request = _chat(tool_choice="auto", regex=re.escape(written), temperature=0)
    text_to_text.run(llm, [WorkItem(job_id=7, request=request)], out, 1)
    assert "".join(c.text for c in out.chunks()) == "Checking."
    end = out.sent[-1]
    assert isinstance(end, End) and end.finish_reason == "tool_calls"
    assert [msgspec.structs.replace(c, id="") for c in end.tool_calls or []] == [WEATHER]


def test_a_model_writing_qwen3_coder_calls_has_their_values_typed_by_the_tool(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model, its format taken as Qwen3-Coder's XML, held by a regex to a call
    whose values are bare text: each is read as its parameter's schema type."""
    monkeypatch.setattr(llm, "tool_format", FORMATS["qwen3_coder"])
    out = FakeOutbox()
    written = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
               "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
               "</tool_call>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    request = kinds.build("generate", [{"role": "user", "content": "weather?"}],
                          tools=tools, tool_choice="auto", regex=re.escape(written),
                          temperature=0)
    text_to_text.run(llm, [WorkItem(job_id=8, request=request)], out, 1)
    assert "".join(c.text for c in out.chunks()) == ""
    end = out.sent[-1]
    assert isinstance(end, End) and end.finish_reason == "tool_calls"
    assert [msgspec.structs.replace(c, id="") for c in end.tool_calls or []] == [
        ToolCall(name="get_weather", arguments='{"city":"Paris","days":3}')]


def test_a_call_cut_short_is_text_and_a_model_that_cannot_read_calls_refuses() -> None:
    out = FakeOutbox()
    text_to_text.run(FakeModelWithCalls(["Hi ", CALL[:30]]),
                     [WorkItem(job_id=1, request=_chat(tool_choice="auto"))], out, 1)
    assert "".join(c.text for c in out.chunks()) == "Hi " + CALL[:30]
    assert out.sent[-1].finish_reason == "stop" and out.sent[-1].tool_calls is None
    out = FakeOutbox()
    text_to_text.run(FakeModel(["x"]), [WorkItem(job_id=2, request=_chat(tool_choice="auto"))],
                     out, 1)
    assert len(out.sent) == 1 and out.sent[0].code is ErrorCode.BAD_REQUEST


class FakeModelWithCalls(FakeModel):
    def tool_reader(self, request: Generate) -> ToolCallReader | None:
        if request.tool_choice != "auto":
            return None
        return ToolCallReader(FORMATS["hermes"], {"get_weather"})
