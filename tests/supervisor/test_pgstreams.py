"""A relayed stream's pieces: carried whole in notifications, and put together for the
client in order, with nothing missing and nothing of another run."""

from __future__ import annotations

from modelpool.supervisor.pgstreams import (
    PAYLOAD_BYTES,
    StreamAssembly,
    StreamPiece,
    parse,
    payloads,
    stream_channel,
)


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


def test_each_node_has_a_channel_of_its_own_whatever_its_name() -> None:
    names = ["alpha", "Alpha", "node with spaces and ünïcode", "x" * 300]
    channels = {stream_channel(name) for name in names}
    assert len(channels) == len(names)
    assert all(c.isidentifier() and c.islower() and len(c) < 64 for c in channels)


def test_the_client_gets_the_text_in_order_and_the_rest_from_the_result() -> None:
    stream = StreamAssembly()
    assert stream.take(StreamPiece("k", 1, 0, "tok0 ")) == "tok0 "
    assert stream.take(StreamPiece("k", 1, 0, "tok0 ")) == ""  # again: sent already
    assert stream.take(StreamPiece("k", 1, 5, "tok1 ")) == "tok1 "
    assert stream.take(StreamPiece("k", 1, 15, "tok3 ")) == ""  # tok2 was lost...
    assert stream.take(StreamPiece("k", 1, 10, "tok2 ")) == ""  # ...so the rest waits
    assert (stream.sent, stream.chunks) == ("tok0 tok1 ", 2)
    assert stream.rest("tok0 tok1 tok2 tok3 ") == "tok2 tok3 "
    assert StreamAssembly().rest("all of it") == "all of it"


def test_a_run_that_replaced_one_the_client_has_part_of_breaks_its_stream() -> None:
    before_any = StreamAssembly()
    assert before_any.take(StreamPiece("k", 1, 0, "")) == ""
    assert before_any.take(StreamPiece("k", 2, 0, "second ")) == "second "  # nothing sent
    assert before_any.rest("second run") == "run"
    assert before_any.rest("first run") is None  # not how the stored text starts

    midway = StreamAssembly()
    assert midway.take(StreamPiece("k", 1, 0, "first ")) == "first "
    assert midway.take(StreamPiece("k", 2, 0, "other ")) is None
    assert midway.rest("other text") is None
