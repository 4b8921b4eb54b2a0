"""An output token's log-probability and its alternatives: from hand-made logits, and
from the tiny random-weight Llama decoding one token at a time."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Generate, TokenLogprob, TopLogprob
from modelpool.registry.loaders.causal_lm import CausalLM
from modelpool.registry.loaders.token_logprobs import (
    FLOOR,
    PROMPT_LOGITS_BYTES,
    check_prompt_logprobs,
    prompt_logprobs,
    token_logprob,
)
from modelpool.workers.capabilities.text_to_text import GenerationStats

PROMPT = "Once upon a time, there was a tiny model"


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i) for i in ids)


def _log_softmax(values: list[float]) -> list[float]:
    total = math.log(sum(math.exp(v) for v in values))
    return [v - total for v in values]


def test_the_tokens_logprob_and_the_likeliest_first() -> None:
    values = [1.0, 3.0, 0.5, 2.0]
    expected = _log_softmax(values)
    entry = token_logprob(torch.tensor(values), 2, 2, Letters())
    assert (entry.token, entry.token_id) == ("c", 2)
    assert math.isclose(entry.logprob, expected[2], rel_tol=1e-6)
    assert [t.token for t in entry.top] == ["b", "d"]  # likeliest first; c is not among them
    assert all(math.isclose(t.logprob, expected[ord(t.token) - 97], rel_tol=1e-6)
               for t in entry.top)
    assert token_logprob(torch.tensor(values), 2, 0, Letters()).top == []
    everything = token_logprob(torch.tensor(values), 0, 20, Letters())  # more than there are
    assert [t.token for t in everything.top] == ["b", "d", "a", "c"]


def test_a_token_the_model_rules_out_is_reported_at_the_floor_not_minus_infinity() -> None:
    entry = token_logprob(torch.tensor([0.0, float("-inf"), 0.0]), 1, 3, Letters())
    assert entry.logprob == FLOOR and entry.top[-1] == TopLogprob("b", FLOOR)
    assert math.isclose(entry.top[0].logprob, math.log(0.5), rel_tol=1e-6)


def test_each_prompt_token_is_predicted_by_the_row_before_it_and_the_first_by_none() -> None:
    rows = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [9.0, 9.0, 9.0]])
    entries = prompt_logprobs(rows, [1, 0, 2], 1, Letters())
    assert [(e.token, e.token_id, e.top) for e in entries[:1]] == [("b", 1, [])]
    assert entries[0].logprob is None and len(entries) == 3
    assert math.isclose(entries[1].logprob or 0, _log_softmax([2.0, 0, 0])[0], rel_tol=1e-6)
    assert math.isclose(entries[2].logprob or 0, _log_softmax([0, 0, 3.0])[2], rel_tol=1e-6)
    assert [e.top[0].token for e in entries[1:]] == ["a", "c"]


def test_prompt_logprobs_of_a_prompt_whose_logits_would_not_fit_are_refused() -> None:
    asked = kinds.build("generate", "p", prompt_logprobs=0).sampling  # type: ignore[attr-defined]
    vocab = 32_000
    fits = PROMPT_LOGITS_BYTES // (vocab * 4)
    check_prompt_logprobs(asked, fits, vocab, "m")
    check_prompt_logprobs(kinds.build("generate", "p").sampling,  # type: ignore[attr-defined]
                          10 * fits, vocab, "m")  # not asked: any length
    with pytest.raises(PoolError) as err:
        check_prompt_logprobs(asked, fits + 1, vocab, "m")
    assert err.value.code is ErrorCode.BAD_REQUEST and f"up to {fits} tokens" in err.value.message


def test_the_prompts_logprobs_keep_its_logits_and_nothing_else_does(
        llm: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt's pass keeps every position's logits only for prompt_logprobs; each
    prompt token's entry is the model's own, as computed without a KV cache."""
    kept: list[int] = []
    forward = llm.model.forward

    @functools.wraps(forward)  # the same signature: the keywords it takes are read from it
    def recording(*args: object, **kwargs: object) -> object:
        out = forward(*args, **kwargs)
        kept.append(out.logits.shape[1])
        return out

    monkeypatch.setattr(llm.model, "forward", recording)
    common = {"prompt": PROMPT, "raw": True, "max_tokens": 3, "temperature": 0.0}
    ids = llm.prompt_ids(Generate(id=1, prompt=PROMPT, raw=True))
    request = kinds.build("generate", **common, prompt_logprobs=2)
    stats = GenerationStats()
    text = "".join(llm.generate(request, stats))  # type: ignore[arg-type]
    assert kept == [len(ids), 1, 1]
    entries = stats.prompt_logprobs or []
    assert [e.token_id for e in entries] == ids and entries[0].logprob is None
    reference = _raw_logprobs(llm, ids[:1], ids[1:])
    assert all(abs((e.logprob or 0) - float(r[e.token_id])) < 1e-4 and len(e.top) == 2
               for e, r in zip(entries[1:], reference, strict=True))
    kept.clear()
    plain = GenerationStats()
    assert "".join(llm.generate(kinds.build("generate", **common), plain)) == text  # type: ignore[arg-type]
    assert kept == [1, 1, 1] and plain.prompt_logprobs is None


def _with_logprobs(llm: CausalLM, **fields: object) -> tuple[str, list[TokenLogprob]]:
    """The text and each piece's token entry, as the stream adapter takes them."""
    stats, text, entries = GenerationStats(), "", []
    prompt = fields.pop("prompt")
    for piece in llm.generate(kinds.build("generate", prompt, **fields), stats):
        text += piece
        entries.extend(stats.take_logprobs() or [])
    assert len(entries) == (0 if fields.get("logprobs") is None else stats.completion_tokens)
    return text, entries


def _raw_logprobs(llm: CausalLM, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The model's own log-probabilities at each output position, without a KV cache."""
    with torch.inference_mode():
        logits = llm.model(input_ids=torch.tensor([ids + tokens])).logits[0].float()
    return [torch.log_softmax(logits[len(ids) - 1 + i], -1) for i in range(len(tokens))]


def test_logprobs_are_each_output_tokens_and_the_likeliest_from_the_raw_logits(
        llm: CausalLM) -> None:
    common = {"prompt": PROMPT, "raw": True, "max_tokens": 10, "ignore_eos": True}
    ids = llm.prompt_ids(Generate(id=1, prompt=PROMPT, raw=True))
    text, entries = _with_logprobs(llm, temperature=0.0, logprobs=3, **common)
    tokens = [e.token_id for e in entries]
    assert text == llm.tokenizer.decode(tokens, skip_special_tokens=True)
    for entry, reference in zip(entries, _raw_logprobs(llm, ids, tokens), strict=True):
        assert entry.token_id == int(reference.argmax())  # greedy, as without a cache
        assert entry.token == llm.tokenizer.decode([entry.token_id])
        assert abs(entry.logprob - float(reference[entry.token_id])) < 1e-4
        assert [t.token for t in entry.top] == [llm.tokenizer.decode([int(i)]) for i in
                                                reference.topk(3).indices]
        assert entry.top[0].logprob == entry.logprob  # greedy: the likeliest
    # Forced by a bias, the tokens keep the model's own (low) log-probability.
    _, forced = _with_logprobs(llm, temperature=0.0, logprobs=0, logit_bias={100: 100},
                               **common)
    assert [e.token_id for e in forced] == [100] * 10 and all(not e.top for e in forced)
    reference = _raw_logprobs(llm, ids, [100] * 10)
    assert all(abs(e.logprob - float(r[100])) < 1e-4 for e, r in zip(forced, reference,
                                                                     strict=True))
    assert max(e.logprob for e in forced) < -1
    assert _with_logprobs(llm, temperature=0.0, **common)[1] == []  # not asked: none
