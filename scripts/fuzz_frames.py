"""Bad frames for the daemon's front door: each deserves exactly one BAD_REQUEST reply,
quickly, with the connection left usable. Used by scripts/adversarial.py and
tests/adversarial/.

    for payload, request_id in fuzzed_frames(1000): ...   # request_id: what the reply names
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import msgspec

from modelpool.protocol.messages import Embed, encoder

Fuzz = tuple[bytes, int | None]  # a payload, and the request id its reply should name
_enc = msgspec.msgpack.encode


def _map(*pairs: bytes) -> bytes:
    """A msgpack map from already encoded keys and values (so they may be invalid)."""
    return bytes([0x80 | len(pairs) // 2]) + b"".join(pairs)


def _bad_utf8(rng: random.Random) -> bytes:
    body = rng.choice([b"\xff", b"\xc3\x28", b"\xe2\x82", b"ok\xf0\x28\x8c\x28", b"\xed\xa0\x80"])
    return bytes([0xA0 | len(body)]) + body


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def _empties(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count


def _random_bytes(rng: random.Random, rid: int) -> Fuzz:
    return rng.randbytes(rng.randint(1, 256)), None


def _truncated(rng: random.Random, rid: int) -> Fuzz:
    whole = encoder.encode(Embed(id=rid, model="noop", texts=["some text"] * rng.randint(1, 8)))
    return whole[: rng.randint(1, len(whole) - 1)], None


def _wrong_types(rng: random.Random, rid: int) -> Fuzz:
    op, id_ = _enc("op"), _enc("id")
    return rng.choice([
        _map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), _enc(123)),
        _map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), _enc([1, 2, 3])),
        _map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), _enc([])),
        _map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), _enc(["a"]),
             _enc("priority"), _enc("urgent")),
        _map(op, _enc("generate"), id_, _enc(rid), _enc("sampling"), _enc("hot")),
        _map(op, _enc("no_such_op"), id_, _enc(rid)),
        _map(id_, _enc(rid)),
    ]), rid


def _invalid_utf8(rng: random.Random, rid: int) -> Fuzz:
    op, id_ = _enc("op"), _enc("id")
    return rng.choice([
        _map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), b"\x91" + _bad_utf8(rng)),
        _map(op, _enc("embed"), id_, _enc(rid), _enc("model"), _bad_utf8(rng),
             _enc("texts"), _enc(["a"])),
        _map(op, _enc("embed"), id_, _enc(rid), _bad_utf8(rng), _enc(1),
             _enc("texts"), b"\x91" + _bad_utf8(rng)),
        _map(op, _enc("generate"), id_, _enc(rid), _enc("prompt"), _bad_utf8(rng)),
    ]), rid


def _deep(rng: random.Random, rid: int) -> Fuzz:
    depth = rng.randint(1_000, 100_000)
    op, id_ = _enc("op"), _enc("id")
    # Walking past a value nested this deep is what fails, so the id is not recovered.
    return rng.choice([
        (_nested(depth), None),
        (_map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), _nested(depth)), None),
        (_map(op, _enc("embed"), id_, _enc(rid), _enc("junk"), _nested(depth)), None),
    ])


def _empty_arrays(rng: random.Random, rid: int) -> Fuzz:
    count = rng.randint(1, 64 * 1024)
    op, id_ = _enc("op"), _enc("id")
    return rng.choice([
        (_empties(count), None),
        (_map(op, _enc("embed"), id_, _enc(rid), _enc("texts"), _empties(count)), rid),
        (_map(op, _enc("embed"), _enc("junk"), _empties(count), id_, _enc(rid)), rid),
    ])


KINDS: list[Callable[[random.Random, int], Fuzz]] = [
    _random_bytes, _truncated, _wrong_types, _invalid_utf8, _deep, _empty_arrays]


def fuzzed_frames(count: int, seed: int = 0) -> Iterator[Fuzz]:
    """count bad frames, every kind in turn; each deserves exactly one BAD_REQUEST."""
    rng = random.Random(seed)
    for i in range(count):
        yield KINDS[i % len(KINDS)](rng, 1000 + i)


def bomb_frame(limit: int, rid: int = 1) -> bytes:
    """The largest frame allowed: a junk field of empty arrays, then the id, so both the
    typed decoding and the recovery of the id must walk all of it."""
    head = b"\x83" + _enc("op") + _enc("embed") + _enc("junk")
    tail = _enc("id") + _enc(rid)
    return head + _empties(limit - len(head) - len(tail) - 5) + tail
