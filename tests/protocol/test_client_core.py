"""The client without I/O: one Call per operation of the request-kind table, the reply
parsers, and the request methods and CLI commands made from the table."""

from __future__ import annotations

import inspect
import itertools

import msgspec
import numpy as np
import pytest

from modelpool.protocol.client import AsyncClient, Client
from modelpool.protocol.client_core import TextChunk, encode_checked, make_call, split_call
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.kinds import BY_OP, KINDS, Kind
from modelpool.protocol.messages import Chunk, Embeddings, End, Error, Generate
from modelpool.supervisor import cli_ops
from modelpool.supervisor.cli import _parser


def test_each_operation_builds_its_request_with_the_common_options() -> None:
    call = make_call("generate", 7, ("Once",), {"max_tokens": 5, "priority": "high",
                                                "deadline_s": 2.0, "tenant": "t"})
    assert isinstance(call.request, Generate) and call.id == 7 and call.request.tenant == "t"
    assert call.request.sampling.max_tokens == 5 and call.request.sampling.temperature is None
    assert call.request.priority == "high" and call.request.sent_at is not None
    assert call.kind.streaming


def test_one_text_gives_one_row_and_a_list_gives_a_matrix() -> None:
    reply = Embeddings(id=1, data=np.arange(6, dtype="<f4").tobytes(), shape=[3, 2])
    single = make_call("embed", 1, ("a",), {})
    many = make_call("embed", 1, (["a", "b", "c"],), {})
    assert single.parse(Embeddings(id=1, data=reply.data[:8], shape=[1, 2])).shape == (2,)
    assert many.parse(reply).tolist() == [[0, 1], [2, 3], [4, 5]]


def test_replies_parse_into_chunks_and_errors_raise() -> None:
    call = make_call("generate", 1, ("x",), {})
    assert call.parse(Chunk(id=1, seq=0, text="hi")) == TextChunk(text="hi")
    last = call.parse(End(id=1, finish_reason="length", completion_tokens=3))
    assert last.finish_reason == "length" and last.completion_tokens == 3
    with pytest.raises(PoolError) as err:
        call.parse(Error(id=1, code=ErrorCode.TIMEOUT, message="slow"))
    assert err.value.code is ErrorCode.TIMEOUT


@pytest.mark.parametrize(("op", "args", "kwargs"), [
    ("teleport", (), {}),
    ("embed", (), {}),  # missing texts
    ("embed", ("x",), {"colour": "red"}),
])
def test_bad_calls_are_bad_requests(op: str, args: tuple, kwargs: dict) -> None:
    with pytest.raises(PoolError) as err:
        make_call(op, 1, args, kwargs)
    assert err.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.op)
def test_every_kind_is_a_client_method_and_a_cli_command(kind: Kind) -> None:
    method = getattr(Client, kind.op)
    params = inspect.signature(method).parameters
    assert {"self", "model", "priority", "timeout_s", "deadline_s", "tenant"} <= set(params)
    assert method.__doc__ and method.__doc__ == getattr(AsyncClient, kind.op).__doc__
    assert inspect.iscoroutinefunction(getattr(AsyncClient, kind.op)) is not kind.streaming
    command = kind.op.replace("_", "-")
    assert _parser().parse_args([command, *_cli_args(kind.op)]).command == command


def _cli_args(op: str) -> list[str]:
    """Enough positional arguments for each command to parse."""
    return {"embed": ["a", "b"], "generate": ["x"], "embed_image": ["a.png"],
            "describe": ["a.png"], "generate_image": ["x", "-o", "x.png"],
            "tokenize": ["x"], "detokenize": ["1", "2"]}.get(op, ["x", "y"])


def test_cli_flags_come_from_the_builder_signature() -> None:
    args = _parser().parse_args(["generate", "hi", "--max-tokens", "3", "--stop", "a",
                                 "--stop", "b", "--ignore-eos", "--priority", "low"])
    assert (args.prompt, args.max_tokens, args.stop, args.ignore_eos) == ("hi", 3, ["a", "b"],
                                                                           True)
    assert args.temperature is None  # unset: the daemon's default applies
    assert _parser().parse_args(["embed", "a", "b"]).texts == ["a", "b"]
    tenant = _parser().parse_args(["embed", "a", "--tenant", "team-a"])
    assert cli_ops._arguments(tenant, BY_OP["embed"])["tenant"] == "team-a"
    assert _parser().parse_args(["describe", "x.png"]).query == ""


def test_an_integer_msgpack_cannot_carry_is_a_bad_request() -> None:
    """A seed beyond 64 bits (from an HTTP body, say) is the caller's mistake, not a
    crash in the encoder."""
    call = make_call("generate", 1, ("hi",), {"seed": 2**70})
    with pytest.raises(PoolError) as refused:
        encode_checked(call.request, None)
    assert refused.value.code is ErrorCode.BAD_REQUEST


def test_a_requests_limits_are_looked_up_once_per_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec's type_info costs ~0.5 ms, more than a whole no-op request through the
    daemon: it once ran for every request a client sent."""
    looked_up = []
    real = msgspec.inspect.type_info
    monkeypatch.setattr(msgspec.inspect, "type_info", lambda t: looked_up.append(t) or real(t))
    ids = itertools.count(1)
    for _ in range(50):
        split_call(make_call("embed", next(ids), (["a", "b"],), {}), ids)
    assert len(looked_up) <= 1
