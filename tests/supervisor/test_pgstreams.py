"""A relayed stream's pieces: carried whole in notifications, and put together for the
client in order, with nothing missing and nothing of another run."""

from __future__ import annotations

from modelpool.protocol.jobs import Completion
from modelpool.protocol.messages import CallDelta, TokenLogprob, ToolCall
from modelpool.supervisor.pgstreams import (
    PAYLOAD_BYTES,
    StreamAssembly,
    StreamPiece,
    call_head,
    logprobs_text,
    parse,
    payloads,
    stream_channel,
)


def _done(text: str, reasoning: str = "", calls: list[ToolCall] | None = None) -> Completion:
    return Completion(text=text, finish_reason="stop", prompt_tokens=1, completion_tokens=1,
                      model="m", reasoning=reasoning, tool_calls=calls)


def test_a_piece_too_long_for_one_notification_is_split_at_whole_characters() -> None:
    text = "aé😀 " * 3000  # 1-, 2- and 4-byte characters: ~26 KB
    piece = StreamPiece("k", 2, 10, text)
    sent = payloads(piece)
    assert len(sent) > 3 and all(len(p.encode()) <= PAYLOAD_BYTES for p in sent)
    parsed = [parse(p) for p in sent]
    assert all(p is not None and (p.key, p.attempt) == ("k", 2) for p in parsed)
    assert "".join(p.text for p in parsed if p) == text
    assert [p.offset for p in parsed if p] == [
        10 + sum(len(q.text) for q in parsed[:i] if q) for i in range(len(parsed))]
    assert payloads(StreamPiece("k", 1, 0, "a\x00b")) == []  # PostgreSQL cannot carry it
    assert parse("k 1 5 with spaces ") == StreamPiece("k", 1, 5, "with spaces ")
    assert parse("garbage") is None
    entries = logprobs_text([TokenLogprob("a b", 7, -0.5, [])])
    for part in ("r", "l", "h3", "c12"):  # thinking, logprobs, a call's head, its arguments
        text = {"h3": call_head(CallDelta(index=3, name="f", id="c")), "l": entries}.get(
            part, "x y")
        (payload,) = payloads(StreamPiece("k", 1, 7, text, part))
        assert parse(payload) == StreamPiece("k", 1, 7, text, part)
    for bad in ("k 1 z:5 x", "k 1 h1:0 not json", "k 1 c:0 x", "k 1 r:x x", "k 1 l:0 [1]"):
        assert parse(bad) is None
    assert payloads(StreamPiece("k", 1, 0, "x" * PAYLOAD_BYTES, "h0")) == []  # whole or none


def test_each_node_has_a_channel_of_its_own_whatever_its_name() -> None:
    names = ["alpha", "Alpha", "node with spaces and ünïcode", "x" * 300]
    channels = {stream_channel(name) for name in names}
    assert len(channels) == len(names)
    assert all(c.isidentifier() and c.islower() and len(c) < 64 for c in channels)


def test_the_client_gets_the_text_in_order_and_the_rest_from_the_result() -> None:
    stream = StreamAssembly()
    assert stream.take(StreamPiece("k", 1, 0, "tok0 ")) is True
    assert stream.take(StreamPiece("k", 1, 0, "tok0 ")) is False  # again: sent already
    assert stream.take(StreamPiece("k", 1, 5, "tok1 ")) is True
    assert stream.take(StreamPiece("k", 1, 15, "tok3 ")) is False  # tok2 was lost...
    assert stream.take(StreamPiece("k", 1, 10, "tok2 ")) is False  # ...so the rest waits
    assert (stream.sent, stream.chunks) == ("tok0 tok1 ", 2)
    assert stream.rest(_done("tok0 tok1 tok2 tok3 ")) == ("tok2 tok3 ", "", [], [])
    assert StreamAssembly().rest(_done("all of it")) == ("all of it", "", [], [])


def test_thinking_and_calls_are_parts_of_their_own_each_in_order() -> None:
    stream = StreamAssembly()
    head = call_head(CallDelta(index=0, name="f", id="call_1"))
    for piece in (StreamPiece("k", 1, 0, "Hmm, ", "r"), StreamPiece("k", 1, 5, "f.", "r"),
                  StreamPiece("k", 1, 0, "Checking."), StreamPiece("k", 1, 0, head, "h0"),
                  StreamPiece("k", 1, 0, '{"a":', "c0")):
        assert stream.take(piece) is True
    whole = _done("Checking.", "Hmm, f.", [ToolCall(name="f", arguments='{"a":1}', id="call_1"),
                                          ToolCall(name="g", arguments="{}", id="call_2")])
    assert stream.rest(whole) == ("", "", [], [CallDelta(index=0, arguments="1}")])
    other = ToolCall(name="f", arguments='{"a":1}', id="call_9")  # another run's call
    assert stream.rest(_done("Checking.", "Hmm, f.", [other])) is None
    # a call's arguments without its head, or a head without the one before: a gap
    assert StreamAssembly().take(StreamPiece("k", 1, 0, "{", "c0")) is False
    skipped = StreamAssembly()
    assert skipped.take(StreamPiece("k", 1, 0, head, "h1")) is False and skipped.gap


def test_a_run_that_replaced_one_the_client_has_part_of_breaks_its_stream() -> None:
    before_any = StreamAssembly()
    assert before_any.take(StreamPiece("k", 1, 0, "")) is False
    assert before_any.take(StreamPiece("k", 2, 0, "second ")) is True  # nothing sent
    assert before_any.rest(_done("second run")) == ("run", "", [], [])
    assert before_any.rest(_done("first run")) is None  # not how the stored text starts

    midway = StreamAssembly()
    assert midway.take(StreamPiece("k", 1, 0, "thought", "r")) is True
    assert midway.take(StreamPiece("k", 2, 0, "other ")) is None
    assert midway.rest(_done("other text", "other thought")) is None


def test_log_probabilities_are_counted_in_tokens_and_the_rest_comes_with_the_result() -> None:
    entries = [TokenLogprob(f"tok{i} ", i, -float(i), []) for i in range(4)]
    stream = StreamAssembly()
    assert stream.take(StreamPiece("k", 1, 0, "tok0 ")) is True
    assert stream.take(StreamPiece("k", 1, 0, logprobs_text(entries[:1]), "l")) is True
    assert stream.take(StreamPiece("k", 1, 0, logprobs_text(entries[:1]), "l")) is False
    assert stream.take(StreamPiece("k", 1, 1, logprobs_text(entries[1:3]), "l")) is True
    assert stream.logprobs == 3
    done = Completion(text="tok0 tok1 tok2 tok3 ", finish_reason="length", prompt_tokens=1,
                      completion_tokens=4, model="m", logprobs=entries)
    assert stream.rest(done) == ("tok1 tok2 tok3 ", "", entries[3:], [])
    assert stream.take(StreamPiece("k", 1, 9, logprobs_text(entries), "l")) is False
    assert stream.gap  # one was lost: the rest waits for the result
