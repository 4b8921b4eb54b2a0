"""Structured output of a reasoning model: the model thinks freely and its language holds
the answer only, from the token after the thinking's closing tag (vLLM's way); or, with
`structured_in_reasoning`, the whole output. tiny-thinker has `<think>` and `</think>` as
tokens of their own, as Qwen3 has; tiny-llm writes them in several tokens."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_reasoning import Outbox

from modelpool.protocol import kinds
from modelpool.protocol.fields import Structured
from modelpool.protocol.messages import Chunk, End
from modelpool.protocol.pipes import WorkItem
from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.grammar import AfterThinking
from modelpool.registry.loaders.reasoning import FORMATS
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities import text_to_text
from modelpool.workers.streams import StreamLoop

QUESTION = [{"role": "user", "content": "a city?"}]
CLOSE_BIAS = 5.0  # sampled, the thinking closes within a few tens of tokens


@pytest.fixture(scope="module")
def thinker(tiny_models_dir: Path) -> Any:
    model = load_model(ModelSpec(key="tiny-thinker", capability="text_to_text",
                                 path=str(tiny_models_dir / "tiny-thinker")))
    assert model.thinking is not None and model.open_token is not None
    return model


def _ids(model: Any, text: str) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def _allowed(matcher: AfterThinking, vocab: int) -> set[int]:
    logits = matcher.mask(torch.zeros(vocab))
    return set(torch.nonzero(logits > float("-inf")).flatten().tolist())


def _after(model: Any, inside: bool, regex: str = r"Paris\.") -> AfterThinking:
    grammar = model.grammars.matcher(Structured(regex=regex))
    return AfterThinking(grammar, "</think>", model.tokenizer, inside, model.open_token)


@pytest.mark.parametrize("name", ["thinker", "llm"])
def test_the_language_starts_after_the_closing_tag_in_one_token_or_several(
        name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(name)
    vocab = len(model.tokenizer)
    matcher = _after(model, inside=True)
    thought = _ids(model, "{ not JSON </thin k> nor Paris")
    for token in thought:  # anything while thinking: no token is held off
        assert len(_allowed(matcher, vocab)) == vocab and not matcher.complete
        matcher.add(token)
    closing = _ids(model, "</think>")
    assert (len(closing) == 1) == (name == "thinker")
    for token in closing:
        matcher.add(token)
    assert _allowed(matcher, vocab) == {_ids(model, "P")[0]}  # held from here
    for token in _ids(model, "Paris."):
        matcher.add(token)
    assert matcher.complete


def test_prose_markers_written_either_way_start_the_language(llm: Any) -> None:
    """Granite 3.2's: "Here is my response:" or "Here's my response:" ends the thinking."""
    vocab = len(llm.tokenizer)
    for marker in ("Here is my response:", "Here's my response:"):
        matcher = AfterThinking(llm.grammars.matcher(Structured(regex=r"Paris\.")),
                                FORMATS["granite"].closings, llm.tokenizer, True, None)
        for token in _ids(llm, f"I think it is Paris. Here is my plan. {marker}"):
            assert len(_allowed(matcher, vocab)) == vocab
            matcher.add(token)
        assert _allowed(matcher, vocab) == {_ids(llm, "P")[0]}


def test_a_model_may_open_the_thinking_itself_else_it_answers_in_the_language(
        thinker: Any) -> None:
    vocab = len(thinker.tokenizer)
    matcher = _after(thinker, inside=False)
    assert _allowed(matcher, vocab) == {_ids(thinker, "P")[0], thinker.open_token}
    matcher.add(thinker.open_token)
    assert len(_allowed(matcher, vocab)) == vocab  # thinking
    answering = _after(thinker, inside=False)
    answering.add(_ids(thinker, "P")[0])
    assert thinker.open_token not in _allowed(answering, vocab)  # no thinking now
    # a multi-token opening tag cannot be told from the answer's start: held at once
    assert thinker.open_token is not None
    held = AfterThinking(thinker.grammars.matcher(Structured(regex="P")), "</think>",
                         thinker.tokenizer, False, None)
    assert _allowed(held, vocab) == {_ids(thinker, "P")[0]}


def _chat(seed: int, **options: Any) -> Any:
    return kinds.build("generate", QUESTION, regex=r"Paris\.", temperature=1.0, seed=seed,
                       max_tokens=64, logit_bias={1025: CLOSE_BIAS}, **options)


def _parts(out: Outbox) -> tuple[str, str, End]:
    chunks = [m for m in out.sent if isinstance(m, Chunk)]
    assert isinstance(out.sent[-1], End)
    return ("".join(c.reasoning for c in chunks), "".join(c.text for c in chunks),
            out.sent[-1])


def test_the_model_thinks_freely_then_answers_in_the_language(thinker: Any) -> None:
    """Its template opens the thinking; what it thinks is not in the language (random
    tokens), its answer is, one request at a time and continuously batched alike."""
    thoughts = []
    paris = len(_ids(thinker, "Paris."))
    for seed in range(3):
        out = Outbox()
        # a stop string holds text back: each token is still known for thinking or not
        request = _chat(seed, stop=["never said"] if seed == 1 else [])
        text_to_text.run(thinker, [WorkItem(job_id=seed, request=request)], out, 1)
        thought, answer, end = _parts(out)
        assert (answer, end.finish_reason) == ("Paris.", "stop")
        assert end.reasoning_tokens == end.completion_tokens - paris  # its tags included
        thoughts.append(thought)
        batched = Outbox()
        loop = StreamLoop(thinker.decoder(),
                          lambda item, o=batched: text_to_text.prepare(thinker, item, o),
                          batched)
        loop._start([WorkItem(job_id=seed, request=_chat(seed))])
        while loop.streams:
            loop._step()
        assert _parts(batched)[:2] == (thought, "Paris.")
        assert _parts(batched)[2].reasoning_tokens == end.reasoning_tokens
    assert any(t and not re.fullmatch(r"Paris\.", t) for t in thoughts)


def test_thinking_switched_off_or_opened_by_the_model_and_held_whole(thinker: Any,
                                                                    monkeypatch: Any) -> None:
    """With an empty thinking in its prompt (Qwen3's enable_thinking false) the model
    answers in the language, or opens the thinking itself (biased one way or the other:
    the random model, greedy, opens it); with structured_in_reasoning the language
    holds its whole output."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = Outbox()
    text_to_text.run(thinker, [WorkItem(job_id=1, request=kinds.build(
        "generate", QUESTION, regex=r"Paris\.", temperature=0,
        logit_bias={thinker.open_token: -100.0}, **off))], out, 1)
    assert _parts(out)[:2] == ("", "Paris.")
    out = Outbox()
    opened = kinds.build("generate", QUESTION, regex=r"Paris\.", temperature=0,
                         logit_bias={thinker.open_token: 100.0, 1025: 200.0}, **off)
    text_to_text.run(thinker, [WorkItem(job_id=2, request=opened)], out, 1)
    thought, answer, end = _parts(out)
    paris = len(_ids(thinker, "Paris."))
    assert (thought, answer, end.completion_tokens) == ("", "Paris.", 2 + paris)
    assert end.reasoning_tokens == 2  # <think></think>
    monkeypatch.setattr(thinker, "structured_in_reasoning", True)
    out = Outbox()
    text_to_text.run(thinker, [WorkItem(job_id=3, request=_chat(0))], out, 1)
    assert _parts(out)[:2] == ("", "Paris.")  # the language allowed no thinking
    # a language that writes the tags writes them in ordinary tokens: llguidance takes
    # tiny-thinker's (added, not special, as Qwen3's) for special ones it cannot consume
    held = kinds.build("generate", QUESTION, regex=re.escape("<think>Hm.</think>Paris."),
                       temperature=0)
    out = Outbox()
    text_to_text.run(thinker, [WorkItem(job_id=4, request=held)], out, 1)
    assert _parts(out)[:2] == ("Hm.", "Paris.")


def test_a_harmony_models_language_starts_with_its_final_channel(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's channels (tiny-llm taken as it, its markers several tokens each) are free
    until the final channel's header, as vLLM holds them: its analysis, a preamble."""
    monkeypatch.setattr(llm, "harmony", True)
    request = kinds.build("generate", QUESTION, regex=r"Paris\.")
    matcher = llm.language(request, llm.prompt_ids(request))
    assert isinstance(matcher, AfterThinking) and matcher.state == "inside"
    vocab = len(llm.tokenizer)
    for token in _ids(llm, "<|channel|>analysis<|message|>Hm, {x}.<|end|><|start|>assistant"
                           "<|channel|>commentary<|message|>Wait.<|end|><|start|>assistant"):
        assert len(_allowed(matcher, vocab)) == vocab
        matcher.add(token)
    for token in _ids(llm, "<|channel|>final<|message|>"):
        matcher.add(token)
    assert _allowed(matcher, vocab) == {_ids(llm, "P")[0]}
    monkeypatch.setattr(llm, "structured_in_reasoning", True)
    assert not isinstance(llm.language(request, llm.prompt_ids(request)), AfterThinking)


def test_a_chats_prompt_is_made_once_for_its_readers_and_its_generation(
        thinker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request at a time, whether the template opened the thinking is read from the
    same prompt the model then runs: its template is rendered once, not twice."""
    rendered = []
    render = thinker.tokenizer.apply_chat_template
    monkeypatch.setattr(thinker.tokenizer, "apply_chat_template",
                        lambda *a, **k: rendered.append(1) or render(*a, **k))
    out = Outbox()
    text_to_text.run(thinker, [WorkItem(job_id=1, request=_chat(0))], out, 1)
    assert _parts(out)[1] == "Paris." and len(rendered) == 1
    text_to_text.run(thinker, [WorkItem(job_id=2, request=_chat(1))], Outbox(), 1)
    assert len(rendered) == 2  # a request of its own: its own prompt
