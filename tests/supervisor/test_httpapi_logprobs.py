"""Log-probabilities over HTTP without a server: how each API asks for them (and the
completions API's echo), and the shapes they are answered in, whole and streamed."""

from __future__ import annotations

import json

import msgspec
import pytest

from modelpool.protocol.client_core import TextChunk, TextResult
from modelpool.protocol.errors import PoolError
from modelpool.protocol.messages import TokenLogprob, TopLogprob
from modelpool.supervisor.httpapi import bodies, completions, replies
from modelpool.supervisor.httpapi.chat import chat_call

CHAT = {"messages": [{"role": "user", "content": "x"}]}


def body(kind: type, **fields: object) -> object:
    return msgspec.convert(fields, type=kind, str_keys=True)  # as JSON gives them


def test_logprobs_are_asked_as_each_api_asks_them() -> None:
    """Chat: logprobs true, with top_logprobs alternatives; completions: logprobs N. The
    pool takes the number of alternatives, None for no logprobs."""
    def chat(**fields: object) -> object:
        return chat_call(body(bodies.ChatBody, **CHAT, **fields)).kwargs["logprobs"]

    def completion(**fields: object) -> object:
        return completions.completion_call(body(bodies.CompletionBody, prompt="p",
                                           **fields)).kwargs["logprobs"]

    assert chat(logprobs=True, top_logprobs=2) == 2 and chat(logprobs=True) == 0
    assert chat() is None and chat(logprobs=False, top_logprobs=0) is None
    assert completion(logprobs=3) == 3 and completion(logprobs=0) == 0
    assert completion() is None
    for call, fields, field in ((chat, {"logprobs": 3}, "logprobs"),
                                (chat, {"top_logprobs": 2}, "top_logprobs"),
                                (chat, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                                (completion, {"logprobs": True}, "logprobs")):
        with pytest.raises(PoolError, match=rf"^BAD_REQUEST: {field}: "):
            call(**fields)
    for too_many in ({"logprobs": True, "top_logprobs": 21}, {"logprobs": -1}):
        with pytest.raises(msgspec.ValidationError, match="logprobs"):
            body(bodies.ChatBody, **CHAT, **too_many)
    with pytest.raises(msgspec.ValidationError, match="logprobs"):
        body(bodies.CompletionBody, prompt="p", logprobs=21)


def _events(data: bytes) -> list[dict]:
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n") if e]


HEL = TokenLogprob("Hel", 7, -0.25, [TopLogprob("Hel", -0.25), TopLogprob("He", -1.5)])
LO = TokenLogprob("lo", 9, -2.0, [TopLogprob("p", -0.5), TopLogprob("lo", -2.0)])
WORLD = TokenLogprob(" w\u00f6rld", 11, -9999.0, [TopLogprob("!", -0.1), TopLogprob("?", -3.0)])


def test_logprobs_in_chat_are_tokens_with_their_bytes_and_alternatives() -> None:
    whole = replies.completion([TextResult("Hello", "length", 1, 2, "m", [HEL, LO])],
                               chat=True, model="m")
    content = whole["choices"][0]["logprobs"]["content"]
    assert content[1] == {"token": "lo", "logprob": -2.0, "bytes": [108, 111], "top_logprobs": [
        {"token": "p", "logprob": -0.5, "bytes": [112]},
        {"token": "lo", "logprob": -2.0, "bytes": [108, 111]}]}
    assert [c["token"] for c in content] == ["Hel", "lo"]
    plain = replies.completion([TextResult("Hello", "length", 1, 2, "m")], chat=True,
                               model="m")
    assert plain["choices"][0]["logprobs"] is None
    shape = replies.StreamShape(chat=True, model="m", include_usage=False)
    events = _events(shape.event(TextChunk("", logprobs=[HEL])) +
                     shape.event(TextChunk("Hello w\u00f6rld", logprobs=[LO, WORLD])) +
                     shape.event(TextChunk("", "length", 1, 3)))
    streamed = [c for e in events for c in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [c["token"] for c in streamed] == ["Hel", "lo", " w\u00f6rld"]
    assert streamed[2]["bytes"] == list(" w\u00f6rld".encode()) and events[2]["choices"][0][
        "logprobs"] is None


def test_logprobs_in_completions_are_parallel_lists_with_text_offsets() -> None:
    shape = replies.StreamShape(chat=False, model="m", include_usage=False, choices=2)
    events = _events(shape.event(TextChunk("Hel", logprobs=[HEL])) +
                     shape.event(TextChunk("x", logprobs=[LO]), index=1) +
                     shape.event(TextChunk("lo w\u00f6rld", logprobs=[LO, WORLD])))
    first, other, second = (e["choices"][0]["logprobs"] for e in events)
    assert first == {"tokens": ["Hel"], "token_logprobs": [-0.25],
                     "top_logprobs": [{"Hel": -0.25, "He": -1.5}], "text_offset": [0]}
    assert other["text_offset"] == [0]  # each choice counts its own text
    assert second["text_offset"] == [3, 5]  # after the first chunk's "Hel"
    assert second["top_logprobs"][1] == {"!": -0.1, "?": -3.0, " w\u00f6rld": -9999.0}
    whole = replies.completion([TextResult("Hello", "stop", 1, 2, "m", [HEL, LO])],
                               chat=False, model="m")
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 3]


def test_echo_asks_for_the_prompts_logprobs_when_logprobs_are_asked_for() -> None:
    def call(**fields: object) -> bodies.PoolCall:
        return completions.completion_call(body(bodies.CompletionBody, prompt=["p"], **fields))

    assert call(echo=True, logprobs=2).kwargs["prompt_logprobs"] == 2
    assert call(echo=True).kwargs["prompt_logprobs"] is None
    assert call(logprobs=2).kwargs["prompt_logprobs"] is None
    echo = body(bodies.CompletionBody, prompt=["p"], echo=True)
    assert completions.echoed(echo) == ["p"]  # type: ignore[arg-type]
    assert completions.echoed(body(bodies.CompletionBody, prompt="p")) is None  # type: ignore[arg-type]


def test_an_echoed_prompt_comes_first_in_the_text_and_the_logprobs() -> None:
    first = TokenLogprob("<s>", 1, None)
    said = TokenLogprob("He", 5, -4.0, [TopLogprob("A", -0.5), TopLogprob("B", -1.0)])
    result = TextResult("llo", "length", 2, 1, "m", [LO], [first, said])
    echoed = replies.completion([result], chat=False, model="m", echo=["He"])["choices"][0]
    assert echoed["text"] == "Hello"
    assert echoed["logprobs"] == {
        "tokens": ["<s>", "He", "lo"], "token_logprobs": [None, -4.0, -2.0],
        "top_logprobs": [None, {"A": -0.5, "B": -1.0, "He": -4.0}, {"p": -0.5, "lo": -2.0}],
        "text_offset": [0, 3, 5]}
    plain = replies.completion([result], chat=False, model="m")["choices"][0]
    assert plain["text"] == "llo" and plain["logprobs"]["tokens"] == ["lo"]
    unasked = TextResult("llo", "length", 2, 1, "m")
    assert replies.completion([unasked], chat=False, model="m", echo=["He"])["choices"][0][
        "text"] == "Hello"


def test_a_prompt_of_token_ids_is_taken_as_evaluation_harnesses_send_it() -> None:
    def call(prompt: object, **fields: object) -> bodies.PoolCall:
        return completions.completion_call(body(bodies.CompletionBody, prompt=prompt, **fields))

    assert call([5, 6, 7]).args == ([5, 6, 7],) and call([[5, 6]]).args == ([5, 6],)
    assert call(["text"]).args == ("text",)
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: prompt: a prompt .* not token ids"):
        call(["a", 5])
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: echo: .* logprobs"):
        call([5, 6], echo=True)
    for bad_ids in ([-1], [[]], []):
        with pytest.raises(msgspec.ValidationError):
            body(bodies.CompletionBody, prompt=bad_ids)
    first = TokenLogprob("<s>", 1, None)
    result = TextResult("lo", "length", 2, 1, "m", [LO], [first, HEL])
    echoed = replies.completion([result], chat=False, model="m", echo=[[1, 7]])["choices"][0]
    assert echoed["text"] == "<s>Hello"  # the ids' tokens as their text
    assert echoed["logprobs"]["tokens"] == ["<s>", "Hel", "lo"]
