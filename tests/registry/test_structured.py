"""Structured output on the tiny random-weight Llama: whatever its weights would say, the
output is in the language asked for, and ends where the language does, one sequence at
a time and continuously batched alike."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.fields import Structured
from modelpool.protocol.messages import Describe, Generate
from modelpool.registry.loaders import grammar as grammar_module
from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.causal_lm import CausalLM
from modelpool.registry.loaders.grammar import Grammars
from modelpool.registry.loaders.vision_lm import VisionLM
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "enum": ["red", "green"]}}}


def _request(prompt: str = "Once upon a time", **fields: Any) -> Generate:
    request = kinds.build("generate", prompt, **{"max_tokens": 60, "temperature": 0,
                                                 "raw": True, **fields})
    assert isinstance(request, Generate)
    assert kinds.kind_of(request).check(request) is None
    return request


def _alone(llm: CausalLM, request: Generate) -> tuple[str, str, int]:
    stats = GenerationStats()
    text = "".join(llm.generate(request, stats))
    return text, stats.finish_reason, stats.completion_tokens


def _batched(llm: CausalLM, requests: list[Generate]) -> dict[int, tuple[str, str, int]]:
    decoder = llm.decoder()
    assert decoder is not None
    for i, request in enumerate(requests):
        decoder.add(i, llm.prepare(request))
    texts = dict.fromkeys(range(len(requests)), "")
    ended: dict[int, tuple[str, str, int]] = {}
    for _ in range(1_000):
        for event in decoder.step():
            assert event.error is None
            texts[event.seq_id] += event.text
            if event.stats is not None:
                ended[event.seq_id] = (texts[event.seq_id], event.stats.finish_reason,
                                       event.stats.completion_tokens)
        if not len(decoder):
            return ended
    raise AssertionError("the decoder did not finish")


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
            and isinstance(value["n"], int) and 0 <= value["n"] <= 99
            and value["tag"] in ("red", "green"))


def test_a_json_schema_holds_the_output_greedy_and_sampled(llm: CausalLM) -> None:
    free = _alone(llm, _request())[0]
    assert not _valid(free)  # the random model alone writes no such thing
    for fields in ({}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.5, "seed": 2}):
        text, finish, tokens = _alone(llm, _request(json_schema=SCHEMA, **fields))
        assert _valid(text), text
        assert finish == "stop" and 0 < tokens < 60  # ended where the object closed
        assert text == json.dumps(json.loads(text))  # as json.dumps writes it


def test_regex_choice_and_lark_grammars(llm: CausalLM) -> None:
    text, finish, _ = _alone(llm, _request(regex=r"[a-z]{3}-[0-9]{2}"))
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) and finish == "stop"
    for seed in range(3):
        text, finish, _ = _alone(llm, _request(choice=["yes", "no", "maybe so"],
                                               temperature=1.0, seed=seed))
        assert text in ("yes", "no", "maybe so") and finish == "stop"
    lark = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[A-Z][a-z]{2,5}/'
    gbnf = 'root ::= ("hello" | "hi") " " [A-Z] [a-z] [a-z] [a-z]?'
    for grammar in (lark, gbnf):
        text, finish, _ = _alone(llm, _request(grammar=grammar))
        assert re.fullmatch(r"(hello|hi) [A-Z][a-z]{2,5}", text) and finish == "stop"


def test_batched_sequences_with_and_without_a_language_equal_one_at_a_time(
        llm: CausalLM) -> None:
    requests = [_request(json_schema=SCHEMA), _request(max_tokens=20, ignore_eos=True),
                _request(json_schema=SCHEMA, temperature=1.0, seed=5),
                _request(regex=r"[a-z]{3}-[0-9]{2}", logit_bias={100: 5.0}),
                _request(choice=["yes", "no"], temperature=0.8, seed=9)]
    together = _batched(llm, requests)
    assert together == {i: _alone(llm, r) for i, r in enumerate(requests)}
    assert _valid(together[0][0]) and _valid(together[2][0])


def test_the_language_ends_the_output_before_min_tokens(llm: CausalLM) -> None:
    """min_tokens holds end-of-sequence off while the language may go on; once it is
    complete nothing else may come, so the output ends there."""
    text, finish, tokens = _alone(llm, _request(choice=["yes", "no"], min_tokens=30))
    assert text in ("yes", "no") and finish == "stop" and tokens < 30
    together = _batched(llm, [_request(choice=["yes", "no"], min_tokens=30)])
    assert together[0] == (text, finish, tokens)


@pytest.mark.parametrize(("fields", "says"), [
    ({"regex": "[a-z"}, "regex"),
    ({"json_schema": {"type": "wat"}}, "wat"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"grammar": "root ::= ("}, "GBNF"),
])
def test_a_grammar_that_is_not_one_is_a_bad_request(llm: CausalLM, fields: dict[str, Any],
                                                      says: str) -> None:
    request = _request(**fields)
    for run in (lambda: llm.prepare(request), lambda: _alone(llm, request)):
        with pytest.raises(PoolError) as caught:
            run()
        assert caught.value.code == ErrorCode.BAD_REQUEST and says in caught.value.message


def test_a_vision_model_answers_in_the_language_alone_and_batched(
        tiny_models_dir: Path) -> None:
    model = load_model(ModelSpec(key="tiny-vision", capability="vision",
                                 path=str(tiny_models_dir / "tiny-vision")))
    assert isinstance(model, VisionLM)
    image = Image.new("RGB", (32, 32), (40, 90, 200))
    request = kinds.build("describe", b"unused", "what is it?", max_tokens=60,
                          temperature=0, json_schema=SCHEMA)
    assert isinstance(request, Describe)
    stats = GenerationStats()
    alone = "".join(model.describe(image, request, stats))
    assert _valid(alone) and stats.finish_reason == "stop"
    decoder = model.decoder()
    assert decoder is not None
    decoder.add(0, model.prepare(image, request))
    batched = ""
    while len(decoder):
        batched += "".join(event.text for event in decoder.step())
    assert batched == alone


def test_a_tokenizer_llguidance_cannot_read_is_a_bad_request_not_a_model_error() -> None:
    """llguidance reads fast (Rust) tokenizers only; a model with another kind refuses
    the request that asks for a language, and stays up for the rest."""
    grammars = Grammars(object(), 10, {0})
    with pytest.raises(PoolError) as caught:
        grammars.matcher(Structured(regex="a+"))
    assert caught.value.code == ErrorCode.BAD_REQUEST
    assert "tokenizer cannot be read" in caught.value.message
    assert grammars.matcher(None) is None


def test_a_grammar_asked_again_is_compiled_once_and_each_sequence_has_its_own_place(
        llm: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = Grammars(llm.tokenizer, llm.vocab, llm.eos_ids)
    compiled: list[Structured] = []
    compile_for_real = grammars.compile
    monkeypatch.setattr(grammars, "compile",
                        lambda s: compiled.append(s) or compile_for_real(s))
    monkeypatch.setattr(grammar_module, "COMPILED_KEPT", 2)
    digits, letters, word = (Structured(regex=r) for r in ("[0-9]{4}", "[a-z]{4}", "word"))
    first = grammars.matcher(digits)
    assert first is not None
    seven = llm.tokenizer.convert_tokens_to_ids("7")
    first.add(seven)  # one sequence has gone on...
    second = grammars.matcher(Structured(regex="[0-9]{4}"))  # ... the same grammar again
    assert second is not None and compiled == [digits]
    logits = torch.zeros(llm.vocab or 0)
    allowed = [int(torch.isfinite(m.mask(logits)).sum()) for m in (first, second)]
    assert allowed[0] == allowed[1] > 0  # both may take a digit...
    for _ in range(3):
        first.add(seven)
    assert first.complete and not second.complete  # ... the copy did not move with it
    grammars.matcher(letters)
    grammars.matcher(digits)  # used last: kept
    grammars.matcher(word)  # the third: the least recently asked (letters) goes
    grammars.matcher(digits)
    grammars.matcher(letters)
    assert compiled == [digits, letters, word, letters]
    with pytest.raises(PoolError):  # a grammar that is not one is not kept
        grammars.matcher(Structured(regex="[a-"))
    assert len(grammars._compiled) == 2
