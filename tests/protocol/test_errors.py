"""The error vocabulary: PoolError's fields and the wire stability of ErrorCode."""

from __future__ import annotations

import msgspec
import pytest

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Error, encoder
from modelpool.protocol.wire import server_decoder


def test_pool_error_carries_its_fields() -> None:
    err = PoolError(ErrorCode.QUEUE_FULL, "queue of 'minilm' is full", retry_after_s=1.5)
    assert err.code is ErrorCode.QUEUE_FULL
    assert err.message == "queue of 'minilm' is full"
    assert err.retry_after_s == 1.5
    assert "QUEUE_FULL" in str(err) and "queue of 'minilm' is full" in str(err)


def test_pool_error_retry_after_defaults_to_none() -> None:
    err = PoolError(ErrorCode.TIMEOUT, "no reply")
    assert err.retry_after_s is None
    assert str(err) == "TIMEOUT: no reply"


def test_pool_error_is_raisable_and_catchable() -> None:
    with pytest.raises(PoolError) as info:
        raise PoolError(ErrorCode.UNAVAILABLE, "daemon down")
    assert info.value.code == "UNAVAILABLE"


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_error_code_value_equals_name(code: ErrorCode) -> None:
    # Values travel on the wire; a renamed value would break every deployed client.
    assert code.value == code.name
    assert ErrorCode(code.name) is code


def test_error_codes_known_to_clients_still_exist() -> None:
    # Removing a code is a wire break too: clients match on these strings.
    expected = {
        "BAD_REQUEST", "PROTOCOL_VERSION", "UNKNOWN_MODEL", "WRONG_CAPABILITY", "TIMEOUT",
        "DEADLINE_EXPIRED", "QUEUE_FULL", "OVERLOADED", "INSUFFICIENT_MEMORY",
        "MODEL_LOAD_FAILED", "MODEL_ERROR", "WORKER_DIED", "CANCELLED", "SHUTTING_DOWN",
        "IMAGE_TOO_LARGE", "URL_NOT_ALLOWED", "UNAVAILABLE", "INTERNAL",
    }
    assert expected <= {c.value for c in ErrorCode}


def test_error_code_travels_as_its_string() -> None:
    payload = encoder.encode(Error(id=1, code=ErrorCode.WORKER_DIED, message="x"))
    assert msgspec.msgpack.decode(payload)["code"] == "WORKER_DIED"
    assert server_decoder.decode(payload).code is ErrorCode.WORKER_DIED

