"""OpenAI's `n` in the HTTP front door, with fake streams: each choice's arguments, the
choices merged as their chunks come or gathered whole, a failure ending them all, and the
answer's shape (one usage, each choice's own index and first delta)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import pytest

from modelpool.protocol.client_core import TextChunk, TextResult
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.httpapi import bodies, choices, replies


class FakeStream:
    """A choice's stream that yields what the test hands it, and says when it closed."""

    def __init__(self) -> None:
        self.items: asyncio.Queue[TextChunk | Exception | None] = asyncio.Queue()
        self.closed = False

    async def run(self) -> AsyncGenerator[TextChunk, None]:
        try:
            while (item := await self.items.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


def _streams(n: int) -> tuple[list[FakeStream], list[AsyncGenerator[Any, None]]]:
    fakes = [FakeStream() for _ in range(n)]
    return fakes, [f.run() for f in fakes]


def test_seeded_choices_take_seed_plus_their_index_and_unseeded_ones_the_same() -> None:
    assert bodies.choice_kwargs({"seed": 7, "top_k": 2}, 3) == [
        {"seed": 7, "top_k": 2}, {"seed": 8, "top_k": 2}, {"seed": 9, "top_k": 2}]
    assert bodies.choice_kwargs({"seed": None}, 2) == [{"seed": None}] * 2
    for n in (0, bodies.MAX_CHOICES + 1):
        with pytest.raises(msgspec.ValidationError, match=r"\$.n"):
            msgspec.convert({"prompt": "p", "n": n}, bodies.CompletionBody)


async def test_choices_are_merged_as_their_chunks_come() -> None:
    fakes, streams = _streams(2)
    for fake, text in zip(fakes, ("a", "b"), strict=True):
        fake.items.put_nowait(TextChunk(text))
    firsts = await choices.firsts(streams)
    assert [c.text for c in firsts] == ["a", "b"]
    merged = choices.chunks(firsts, streams)
    got = [await anext(merged), await anext(merged)]
    assert sorted(got, key=lambda g: g[0]) == [(0, firsts[0]), (1, firsts[1])]
    fakes[1].items.put_nowait(TextChunk("b2", "stop", 3, 2))
    fakes[1].items.put_nowait(None)
    assert await anext(merged) == (1, TextChunk("b2", "stop", 3, 2))  # 1 before 0: as it came
    fakes[0].items.put_nowait(TextChunk("a2", "length", 3, 4))
    fakes[0].items.put_nowait(None)
    assert [item async for item in merged] == [(0, TextChunk("a2", "length", 3, 4))]
    assert all(f.closed for f in fakes)


async def test_a_choice_that_fails_ends_the_merged_stream_and_closes_the_others() -> None:
    fakes, streams = _streams(3)
    for fake in fakes:
        fake.items.put_nowait(TextChunk("x"))
    merged = choices.chunks(await choices.firsts(streams), streams)
    for _ in range(3):
        await anext(merged)
    fakes[2].items.put_nowait(PoolError(ErrorCode.WORKER_DIED, "gone"))
    with pytest.raises(PoolError, match="gone"):
        await anext(merged)
    assert all(f.closed for f in fakes)  # the other two were still running


async def test_a_choice_refused_before_its_first_chunk_refuses_them_all() -> None:
    fakes, streams = _streams(2)
    fakes[0].items.put_nowait(TextChunk("fine"))
    fakes[1].items.put_nowait(PoolError(ErrorCode.QUEUE_FULL, "full"))
    with pytest.raises(PoolError, match="full"):
        await choices.firsts(streams)
    assert all(f.closed for f in fakes)


async def test_choices_gathered_whole_and_a_failure_cancels_the_others() -> None:
    fakes, streams = _streams(2)
    for fake, (text, tokens) in zip(fakes, (("one", 1), ("two", 2)), strict=True):
        fake.items.put_nowait(TextChunk(text))
        fake.items.put_nowait(TextChunk("!", "stop", 5, tokens))
        fake.items.put_nowait(None)
    got = await choices.gather_all(await choices.firsts(streams), streams, "m")
    assert got == [TextResult("one!", "stop", 5, 1, "m"), TextResult("two!", "stop", 5, 2, "m")]
    fakes, streams = _streams(2)
    for fake in fakes:
        fake.items.put_nowait(TextChunk("x"))
    gathering = asyncio.ensure_future(
        choices.gather_all(await choices.firsts(streams), streams, "m"))
    fakes[0].items.put_nowait(PoolError(ErrorCode.TIMEOUT, "slow"))
    with pytest.raises(PoolError, match="slow"):
        await gathering
    assert all(f.closed for f in fakes)


def _events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n") if e]


def test_a_streamed_answer_of_two_choices_sends_one_usage_after_both() -> None:
    shape = replies.StreamShape(chat=True, model="m", include_usage=True, choices=2, n=2)
    data = (shape.event(TextChunk("a"), 0) + shape.event(TextChunk("b"), 1)
            + shape.event(TextChunk("a2", "stop", 4, 3, reasoning_tokens=2), 0))
    assert not [e for e in _events(data) if e["usage"]]  # choice 1 still runs
    data += shape.event(TextChunk("b2", "length", 4, 5, reasoning_tokens=5), 1)
    events = _events(data)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert [e["choices"][0]["index"] for e in events[:4]] == [0, 1, 0, 1]
    assert events[4]["choices"] == [] and events[4]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 7}}  # of each choice's


def test_a_whole_answer_has_a_choice_each_and_counts_the_prompt_once() -> None:
    answer = replies.completion([TextResult("x", "stop", 4, 1, "m"),
                                 TextResult("yz", "length", 4, 2, "m", reasoning_tokens=1)],
                                chat=False, model="m",
                                n=2)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "x", "stop"), (1, "yz", "length")]
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                               "prompt_tokens_details": {"cached_tokens": 0},
                               "completion_tokens_details": {"reasoning_tokens": 1}}


def test_several_prompts_count_each_prompt_once_whole_and_streamed() -> None:
    """Two prompts of 4 and 6 tokens (3 and 5 of them from the prefix cache), two choices
    each: choices 0-1 are the first's."""
    texts = [TextResult(t, "stop", p, 1, "m", cached_tokens=p - 1)
             for t, p in (("a", 4), ("b", 4), ("c", 6), ("d", 6))]
    answer = replies.completion(texts, chat=False, model="m", echo=["P:", "Q:"], n=2)
    assert [c["text"] for c in answer["choices"]] == ["P:a", "P:b", "Q:c", "Q:d"]
    assert answer["usage"]["prompt_tokens"] == 10
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    shape = replies.StreamShape(chat=False, model="m", include_usage=True, choices=4, n=2)
    data = b"".join(shape.event(TextChunk(t.text, "stop", t.prompt_tokens, 1,
                                          cached_tokens=t.cached_tokens), i)
                    for i, t in enumerate(texts))
    assert _events(data)[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 4,
                                          "total_tokens": 14,
                                          "prompt_tokens_details": {"cached_tokens": 8},
                                          "completion_tokens_details": {"reasoning_tokens": 0}}


def test_a_streamed_echo_puts_each_choices_prompt_before_its_first_chunk_only() -> None:
    shape = replies.StreamShape(chat=False, model="m", include_usage=False, choices=4, n=2,
                                echo=["P:", "Q:"])
    sent = [(0, "a"), (2, "c"), (0, "b"), (1, "x"), (3, "y"), (2, "d"), (1, ""), (3, "z")]
    texts: dict[int, str] = {}
    for index, text in sent:
        event = _events(shape.event(TextChunk(text, None, 0, 0), index))[0]["choices"][0]
        texts[index] = texts.get(index, "") + event["text"]
    assert texts == {0: "P:ab", 1: "P:x", 2: "Q:cd", 3: "Q:yz"}
    plain = replies.StreamShape(chat=False, model="m", include_usage=False)
    assert _events(plain.event(TextChunk("a", None, 0, 0)))[0]["choices"][0]["text"] == "a"
