"""The client without I/O: each operation of the request-kind table becomes (message,
reply parser, streaming or not) here, once. Client and AsyncClient only do the round
trip; the job API uses the same calls.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import MAX_FRAME_BYTES
from modelpool.protocol.jobs import Completion, Follow, JobResult, Submit
from modelpool.protocol.kinds import BY_OP, STREAMED, Kind, merge_rows
from modelpool.protocol.messages import (
    CallDelta,
    Chunk,
    Detokenized,
    End,
    Error,
    ImageProgress,
    Tokenized,
    TokenLogprob,
    ToolCall,
    Welcome,
    encoder,
)
from modelpool.protocol.messages import Image as ImageMsg


@dataclass(frozen=True)
class TextChunk:
    text: str
    finish_reason: str | None = None  # set on the last chunk only
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # with logprobs asked for: the tokens made since the last chunk (see messages.Chunk)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # the last chunk's, if asked for
    tool_calls: list[ToolCall] | None = None  # the last chunk's: the calls the model made
    cached_tokens: int | None = None  # the last chunk's: prompt tokens of the prefix cache
    reasoning: str = ""  # a reasoning model's thinking since the last chunk, not its answer
    reasoning_tokens: int | None = None  # the last chunk's: of completion_tokens, thinking
    # pieces of tool calls as the model writes them ("auto"; see messages.CallDelta)
    calls: list[CallDelta] | None = None


@dataclass(frozen=True)
class ImageChunk:
    """Progress of generate_image; the last chunk carries the finished image in .png."""

    step: int
    total_steps: int
    preview_png: bytes | None = None
    png: bytes | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class TextResult:
    """A generate or describe job's result, retrieved whole."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    logprobs: list[TokenLogprob] | None = None  # every output token's, if asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # every prompt token's, if asked for
    tool_calls: list[ToolCall] | None = None  # the calls the model made (tool_choice "auto")
    cached_tokens: int = 0  # of prompt_tokens, taken from the worker's prefix cache
    reasoning: str = ""  # a reasoning model's thinking, apart from its answer (text)
    reasoning_tokens: int = 0  # of completion_tokens, the thinking's


def job_result(reply: JobResult) -> Any:
    """What the direct call would have returned: an array (one row for one input), a
    TextResult, the final ImageChunk with .png, or tokenize's and detokenize's reply."""
    result = reply.result
    if isinstance(result, Completion):
        return TextResult(result.text, result.finish_reason, result.prompt_tokens,
                          result.completion_tokens, result.model, result.logprobs,
                          result.prompt_logprobs, result.tool_calls, result.cached_tokens,
                          result.reasoning, result.reasoning_tokens)
    if isinstance(result, ImageMsg):
        return image_chunk(result)
    if isinstance(result, Tokenized | Detokenized):
        return result
    array = np.frombuffer(result.data, dtype=_little_endian(result.dtype))
    array = array.reshape(result.shape)
    return array[0] if reply.single else array


def submit_message(rid: int, op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   stream: bool = False) -> Submit:
    """The Submit for `client.submit(op, *args, **kwargs)`: the request the direct call
    would send."""
    call = make_call(op, 0, args, kwargs)
    return Submit(id=rid, request=call.request, single=call.single, stream=stream)


def follow_call(rid: int, key: str) -> Call:
    """`client.follow(key)`: a text job's stream, read as generate's."""
    return Call(BY_OP["generate"], Follow(id=rid, key=key), False)


@dataclass(slots=True)  # (frozen, one took ~1 us to make, of ~21 a no-op request costs)
class Call:
    """One operation, ready to send: its request and how to read what comes back."""

    kind: Kind
    request: Any
    single: bool  # one input where a list was possible: the reply is one row

    @property
    def id(self) -> int:
        return int(self.request.id)

    def parse(self, msg: Any) -> Any:
        """A final reply into the result (array kinds), or a reply into a chunk (streams).
        Raises PoolError for an Error."""
        msg = check_reply(msg)
        if self.kind.reply == "array":
            array = np.frombuffer(msg.data, dtype=_little_endian(msg.dtype))
            array = array.reshape(msg.shape)
            return array[0] if self.single else array
        if self.kind.reply == "text":
            return text_chunk(msg)
        if self.kind.reply == "message":
            return msg
        return image_chunk(msg)


@functools.cache
def _little_endian(dtype: str) -> np.dtype[Any]:
    """The wire's dtype, built once per name: each time, it was a third of parsing a reply."""
    return np.dtype(dtype).newbyteorder("<")


def max_inputs(kind: Kind) -> int | None:
    """How many inputs one request of a batched kind may carry (the wire's max_length)."""
    return None if kind.inputs is None else _max_length(kind.request, kind.inputs)


@functools.cache
def _max_length(request: type, field_name: str) -> int | None:
    """Once per request type: msgspec's type_info takes ~0.5 ms, more than a whole no-op
    request. (Cached by the Kind itself, every call hashed all of its fields.)"""
    info = msgspec.inspect.type_info(request)
    field = next(f for f in info.fields if f.name == field_name)
    return getattr(field.type, "max_length", None)


def split_call(call: Call, ids: Iterator[int]) -> list[Any]:
    """The request itself, or, when it carries more inputs than one request may (4,096
    texts), parts of at most that many with ids of their own, in order."""
    limit = max_inputs(call.kind)
    if limit is None or call.kind.size(call.request) <= limit:
        return [call.request]
    return [msgspec.structs.replace(part, id=next(ids))
            for part in call.kind.split(call.request, limit)]


def merged(call: Call, replies: list[Any]) -> Any:
    """The parts' replies as the one reply of the whole request; PoolError for an Error."""
    return call.parse(merge_rows([check_reply(r) for r in replies]))


def whole_reply(replies: list[Any]) -> Any:
    """The final reply message itself (the parts' merged), unparsed; PoolError for an
    Error."""
    checked = [check_reply(r) for r in replies]
    return checked[0] if len(checked) == 1 else merge_rows(checked)


def unstreamed_call(op: str, rid: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """make_call for `reply()`, which has no stream to give."""
    call = make_call(op, rid, args, kwargs)
    if call.kind.streaming:
        raise PoolError(ErrorCode.BAD_REQUEST, f"{op} streams: call it, not reply()")
    return call


def make_call(op: str, rid: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """The Call for `client.<op>(*args, **kwargs)`."""
    kind = BY_OP.get(op)
    if kind is None:
        raise PoolError(ErrorCode.BAD_REQUEST, f"no operation {op!r}; one of {sorted(BY_OP)}")
    priority = kwargs.pop("priority", "normal")
    timeout_s = kwargs.pop("timeout_s", None)
    deadline_s = kwargs.pop("deadline_s", None)
    tenant = kwargs.pop("tenant", "")
    try:
        fields, single = kind.build(*args, **kwargs)
        # sent_at lets the daemon count a deadline from when the request left the client.
        request = kind.request(id=rid, priority=priority, timeout_s=timeout_s,
                               deadline_s=deadline_s, tenant=tenant, **fields,
                               sent_at=None if deadline_s is None else time.time())
    except (TypeError, msgspec.ValidationError) as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, f"{op}: {exc}") from None
    return Call(kind, request, single)


def op_signature(kind: Kind, is_method: bool = True) -> inspect.Signature:
    """What the user calls: the builder's parameters plus the options every request takes."""
    params = list(inspect.signature(kind.build).parameters.values())
    common = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                annotation=annotation)
              for name, default, annotation in (("priority", "normal", "Priority"),
                                                ("timeout_s", None, "float | None"),
                                                ("deadline_s", None, "float | None"),
                                                ("tenant", "", "str"))]
    self_param = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return inspect.Signature([*(self_param if is_method else []), *params, *common])


def text_chunk(msg: Any) -> TextChunk:
    if isinstance(msg, Chunk):
        return TextChunk(text=msg.text, logprobs=msg.logprobs, reasoning=msg.reasoning,
                         calls=msg.calls)
    assert isinstance(msg, End)
    return TextChunk(text="", finish_reason=msg.finish_reason, prompt_tokens=msg.prompt_tokens,
                     completion_tokens=msg.completion_tokens,
                     prompt_logprobs=msg.prompt_logprobs, tool_calls=msg.tool_calls,
                     cached_tokens=msg.cached_tokens,
                     reasoning_tokens=msg.reasoning_tokens)


def image_chunk(msg: Any) -> ImageChunk:
    if isinstance(msg, ImageProgress):
        return ImageChunk(step=msg.step, total_steps=msg.total_steps,
                          preview_png=msg.preview_png)
    assert isinstance(msg, ImageMsg)
    return ImageChunk(step=-1, total_steps=-1, png=msg.png, width=msg.width,
                      height=msg.height, seed=msg.seed)


def is_last(chunk: TextChunk | ImageChunk) -> bool:
    if isinstance(chunk, ImageChunk):
        return chunk.png is not None
    return chunk.finish_reason is not None


def is_final(msg: Any) -> bool:
    """Does this reply end its request?"""
    return not isinstance(msg, STREAMED)


def check_reply(msg: Any) -> Any:
    if type(msg) is Error:  # (isinstance of a msgspec type costs 5x as much)
        raise PoolError(msg.code, msg.message, msg.retry_after_s)
    return msg


def encode_checked(msg: msgspec.Struct, welcome: Welcome | None) -> bytes:
    """Encode, refusing locally what the daemon would refuse as too large, or what
    msgpack cannot carry (an integer beyond 64 bits)."""
    try:
        payload = encoder.encode(msg)
    except OverflowError as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, f"{type(msg).__name__}: {exc}") from None
    limit = welcome.max_frame_bytes if welcome else MAX_FRAME_BYTES
    if len(payload) > limit:
        raise PoolError(ErrorCode.BAD_REQUEST,
                        f"request of {len(payload)} bytes exceeds the daemon's limit of {limit}")
    return payload


def undecodable(exc: Exception) -> PoolError:
    """A reply this client cannot read: most likely a daemon of a newer version."""
    return PoolError(ErrorCode.PROTOCOL_VERSION, f"cannot decode the daemon's reply ({exc}); "
                     "is the client older than the daemon?")


def unavailable(path: str, exc: BaseException) -> PoolError:
    return PoolError(ErrorCode.UNAVAILABLE, f"cannot reach the modelpool daemon at {path}: "
                     f"{exc} (is `modelpool serve` running?)")


def named_method(method: Callable[..., Any], kind: Kind, owner: type) -> Callable[..., Any]:
    """The method `op` of owner, described as its row's builder is."""
    method.__name__ = kind.op
    method.__qualname__ = f"{owner.__name__}.{kind.op}"
    method.__doc__ = kind.build.__doc__
    method.__signature__ = op_signature(kind)  # type: ignore[attr-defined]
    return method
