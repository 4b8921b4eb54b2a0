"""A client's frame decoded by the front door: never raises, and what cannot be decoded
is a BAD_REQUEST naming the request id when one can be found."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embed, Error
from modelpool.supervisor.frontdoor import decode_request

enc = msgspec.msgpack.encode


def test_invalid_utf8_is_a_bad_request_naming_the_id() -> None:
    payload = (b"\x83" + enc("op") + enc("embed") + enc("id") + enc(7)
               + enc("texts") + b"\x91\xa1\xff")
    err = decode_request(payload)
    assert isinstance(err, Error) and err.id == 7 and err.code is ErrorCode.BAD_REQUEST
    assert "UTF-8" in err.message


def test_deep_nesting_is_a_bad_request() -> None:
    payload = b"\x82" + enc("id") + enc(3) + enc("junk") + b"\x91" * 200_000 + b"\xc0"
    err = decode_request(payload)
    assert isinstance(err, Error) and err.code is ErrorCode.BAD_REQUEST
    assert "nested too deeply" in err.message


def test_the_id_is_found_past_a_bomb_without_building_it() -> None:
    count = 1 << 20
    payload = (b"\x83" + enc("op") + enc("embed") + enc("junk") + b"\xdd"
               + count.to_bytes(4, "big") + b"\x90" * count + enc("id") + enc(11))
    err = decode_request(payload)
    assert isinstance(err, Error) and err.id == 11


def test_a_good_request_decodes() -> None:
    msg = Embed(id=1, texts=["a"])
    assert decode_request(enc(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_no_bytes_make_decoding_raise(payload: bytes) -> None:
    decode_request(payload)
