"""Continuous batching of decoder sequences on the tiny random-weight models: the same
tokens as one sequence at a time, however sequences join, leave and share steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from PIL import Image

from modelpool.protocol import kinds
from modelpool.protocol.messages import Generate, TokenLogprob
from modelpool.registry.loaders import batch_fit, batched_decode, load_model
from modelpool.registry.loaders.batched_decode import ContinuousDecoder
from modelpool.registry.loaders.causal_lm import CausalLM
from modelpool.registry.loaders.vision_lm import VisionLM
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats

Outcome = tuple[str, str, int, int]  # text, finish reason, prompt and completion tokens


def _request(i: int, **fields: Any) -> Generate:
    prompt = f"Once upon a time {'there was a tiny model ' * (i % 4)}number {i}"
    defaults: dict[str, Any] = {"max_tokens": 24 + 7 * i, "temperature": 0, "raw": True,
                                "ignore_eos": i % 2 == 0}
    request = kinds.build("generate", prompt, **{**defaults, **fields})
    assert isinstance(request, Generate)
    return request


def _alone(llm: CausalLM, request: Generate) -> Outcome:
    stats = GenerationStats()
    text = "".join(llm.generate(request, stats))
    return text, stats.finish_reason, stats.prompt_tokens, stats.completion_tokens


def _run(decoder: ContinuousDecoder, arrivals: dict[int, list[tuple[int, Any]]],
         drop: dict[int, list[int]] | None = None,
         logprobs: dict[int, list[TokenLogprob]] | None = None
         ) -> tuple[dict[int, Outcome], int]:
    """Step until every sequence ended: arrivals[step] join before that step, drop[step]
    leave before it. Returns each one's outcome and the steps taken; each one's token
    entries go to `logprobs`."""
    texts: dict[int, str] = {}
    outcomes: dict[int, Outcome] = {}
    step = 0
    while len(decoder) or any(s >= step for s in arrivals):
        for seq_id, prepared in arrivals.get(step, []):
            decoder.add(seq_id, prepared)
            texts[seq_id] = ""
        for seq_id in (drop or {}).get(step, []):
            assert decoder.drop(seq_id) is not None
        for event in decoder.step():
            assert event.error is None
            texts[event.seq_id] += event.text
            if event.logprob is not None and logprobs is not None:
                logprobs.setdefault(event.seq_id, []).append(event.logprob)
            if event.stats is not None:
                s = event.stats
                outcomes[event.seq_id] = (texts[event.seq_id], s.finish_reason,
                                          s.prompt_tokens, s.completion_tokens)
        step += 1
        assert step < 10_000
    return outcomes, step


def _greedy_token(llm: CausalLM, request: Generate, at: int) -> int:
    """The token greedy decoding picks at position `at` of its output."""
    ids = llm.prompt_ids(request)
    with torch.inference_mode():
        for _ in range(at + 1):
            token = int(llm.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
    return token


def test_eight_greedy_sequences_joining_at_different_steps_equal_one_at_a_time(
        llm: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [_request(i) for i in range(8)]
    # A token the random model does emit stands in for end-of-sequence, so that some
    # sequences end on it (the odd ones: the even ones ignore it).
    monkeypatch.setattr(llm, "eos_ids", {*llm.eos_ids, _greedy_token(llm, requests[1], 5)})
    decoder = llm.decoder()
    assert decoder is not None
    arrivals = {0: [(i, llm.prepare(requests[i])) for i in range(3)],
                5: [(3, llm.prepare(requests[3]))],
                6: [(i, llm.prepare(requests[i])) for i in range(4, 8)]}
    together, _ = _run(decoder, arrivals)
    assert together == {i: _alone(llm, r) for i, r in enumerate(requests)}
    assert {o[1] for o in together.values()} == {"length", "stop"}  # eos ends some
    assert len(decoder.rows.seqs) == 0 and decoder.rows.cache is None  # all freed


def test_sampled_sequences_with_seeds_equal_one_at_a_time(llm: CausalLM) -> None:
    requests = [_request(i, temperature=0.9, top_p=0.8, seed=100 + i) for i in range(6)]
    decoder = llm.decoder()
    assert decoder is not None
    together, _ = _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(requests)]})
    assert together == {i: _alone(llm, r) for i, r in enumerate(requests)}


def test_top_k_and_min_p_apply_batched_as_one_at_a_time(llm: CausalLM) -> None:
    """top_k 1 and min_p 1 are greedy at any temperature and seed; top_k 5 with min_p is
    sampled, the same batched as alone."""
    greedy = [_request(i, max_tokens=30, ignore_eos=True) for i in range(2)]
    narrowed = [_request(i, max_tokens=30, ignore_eos=True, temperature=1.5, seed=7 + s,
                         **narrow) for i in range(2) for s, narrow in
                enumerate([{"top_k": 1}, {"min_p": 1.0}, {"top_k": 5, "min_p": 0.05}])]
    decoder = llm.decoder()
    assert decoder is not None
    together, _ = _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(narrowed)]})
    assert together == {i: _alone(llm, r) for i, r in enumerate(narrowed)}
    for i in range(2):
        assert together[3 * i] == together[3 * i + 1] == _alone(llm, greedy[i])
    assert together[2][0] != _alone(llm, greedy[0])[0]  # sampled: not greedy


def test_penalties_apply_batched_as_one_at_a_time(llm: CausalLM) -> None:
    """Greedy and sampled sequences with penalties beside ones without: each as alone,
    and greedy with a penalty is not plain greedy."""
    penalties = [{"repetition_penalty": 2.0}, {"frequency_penalty": 1.0},
                 {"presence_penalty": 1.5, "temperature": 0.9, "seed": 3},
                 {"logit_bias": {100: 50.0, 409: -100.0}}, {}]
    requests = [_request(i, max_tokens=30, ignore_eos=True, **fields)
                for i in range(2) for fields in penalties]
    decoder = llm.decoder()
    assert decoder is not None
    together, _ = _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(requests)]})
    assert together == {i: _alone(llm, r) for i, r in enumerate(requests)}
    for i in (0, 1, 3, 5, 6, 8):
        assert together[i][0] != together[5 * (i // 5) + 4][0]


def test_logprobs_batched_are_as_one_at_a_time(llm: CausalLM) -> None:
    """Sequences asking for logprobs beside ones that do not: the same tokens and
    entries as alone (log-probabilities to float precision: rows share padded passes)."""
    requests = [_request(i, max_tokens=12, ignore_eos=True, **fields) for i in range(2)
                for fields in ({"logprobs": 2}, {"logprobs": 0, "temperature": 0.9,
                                                 "seed": 4}, {})]
    decoder = llm.decoder()
    assert decoder is not None
    entries: dict[int, list[TokenLogprob]] = {}
    together, _ = _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(requests)]},
                       logprobs=entries)
    assert together == {i: _alone(llm, r) for i, r in enumerate(requests)}
    assert sorted(entries) == [0, 1, 3, 4]
    for i, got in entries.items():
        stats = GenerationStats()
        alone = []
        for _ in llm.generate(requests[i], stats):
            alone.extend(stats.take_logprobs() or [])
        assert [(e.token, e.token_id, [t.token for t in e.top]) for e in got] == [
            (e.token, e.token_id, [t.token for t in e.top]) for e in alone]
        assert len(got) == 12 and len(got[0].top) == requests[i].sampling.logprobs
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, alone, strict=True)) < 1e-4


def test_a_sequence_asking_for_its_prompts_logprobs_is_prefilled_alone_and_gets_them(
        llm: CausalLM) -> None:
    requests = [_request(i, max_tokens=6, **fields) for i, fields in enumerate(
        [{}, {"prompt_logprobs": 2}, {}, {"prompt_logprobs": 0, "logprobs": 0}])]
    decoder = llm.decoder()
    assert decoder is not None
    for i, request in enumerate(requests):
        decoder.add(i, llm.prepare(request))
    ended: dict[int, GenerationStats] = {}
    prefills = []
    while len(decoder):
        waiting = len(decoder.waiting)
        for event in decoder.step():
            if event.stats is not None:
                ended[event.seq_id] = event.stats
        prefills += [waiting - len(decoder.waiting)] if waiting != len(decoder.waiting) else []
    assert prefills == [2, 1, 1]  # 0 and 2 share a pass; 1 and 3 each have their own
    for i, request in enumerate(requests):
        alone = GenerationStats()
        list(llm.generate(request, alone))
        got, expected = ended[i].prompt_logprobs, alone.prompt_logprobs
        if expected is None:
            assert got is None
            continue
        assert got is not None and len(got) == ended[i].prompt_tokens
        assert [(e.token_id, [t.token for t in e.top]) for e in got] == [
            (e.token_id, [t.token for t in e.top]) for e in expected]
        assert max(abs((a.logprob or 0) - (b.logprob or 0)) for a, b in zip(
            got, expected, strict=True)) < 1e-4


def test_stop_tokens_end_batched_sequences_as_they_end_alone(llm: CausalLM) -> None:
    """Each greedy sequence's stop token is the one it outputs fourth: it ends by its
    fourth token (sooner if that token came before), beside one that has none."""
    plain = [_request(i, max_tokens=30, ignore_eos=True) for i in range(4)]
    requests = [_request(i, max_tokens=30, ignore_eos=True,
                         stop_token_ids=[_greedy_token(llm, plain[i], 3)]) for i in range(3)]
    requests.append(plain[3])
    # a fifth whose stop token is every token it would output: min_tokens hold it off
    requests.append(_request(4, max_tokens=30, logit_bias={100: 100}, stop_token_ids=[100],
                             min_tokens=5))
    decoder = llm.decoder()
    assert decoder is not None
    together, _ = _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(requests)]})
    assert together == {i: _alone(llm, r) for i, r in enumerate(requests)}
    assert [(together[i][1], together[i][3] <= 3) for i in range(5)] == [
        ("stop", True)] * 3 + [("length", False), ("stop", False)]
    assert together[4][3] == 5


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(
        llm: CausalLM) -> None:
    long = kinds.build("generate", "tiny model " * 400, max_tokens=12, temperature=0,
                       raw=True, ignore_eos=True)
    assert isinstance(long, Generate)
    short = [_request(i, max_tokens=60, ignore_eos=True) for i in range(3)]
    decoder = llm.decoder()
    assert decoder is not None
    decoder.prefill_budget = lambda: decoder.least_prefill  # type: ignore[method-assign]
    prepared = llm.prepare(long)
    assert prepared.prompt_tokens > 2 * decoder.prefill_tokens
    arrivals = {0: [(i, llm.prepare(r)) for i, r in enumerate(short)], 3: [(9, prepared)]}
    outcomes, steps = _run(decoder, arrivals)
    assert outcomes[9] == _alone(llm, long)
    assert all(outcomes[i] == _alone(llm, r) for i, r in enumerate(short))
    # One step prefilled the short ones (their first token), 59 decoded the rest, and the
    # long prompt's chunks took turns with those: no short one waited for the whole of it.
    chunks = -(-prepared.prompt_tokens // decoder.prefill_tokens)
    assert chunks > 2 and steps == 1 + 59 + chunks


def test_a_dropped_sequence_leaves_the_others_untouched(llm: CausalLM) -> None:
    requests = [_request(i, max_tokens=40, ignore_eos=True) for i in range(4)]
    decoder = llm.decoder()
    assert decoder is not None
    outcomes, _ = _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(requests)]},
                       drop={10: [1], 12: [3]})
    assert set(outcomes) == {0, 2}
    assert outcomes[0] == _alone(llm, requests[0])
    assert outcomes[2] == _alone(llm, requests[2])
    assert decoder.drop(1) is None  # gone already


def test_vision_sequences_batch_like_text(tiny_models_dir: Path) -> None:
    model = load_model(ModelSpec(key="tiny-vision", capability="vision",
                                 path=str(tiny_models_dir / "tiny-vision")))
    assert isinstance(model, VisionLM)
    images = [Image.new("RGB", (32, 32), (40 * i, 90, 200 - 30 * i)) for i in range(4)]
    penalties = {"repetition_penalty": 2.0, "frequency_penalty": 0.5}  # on the odd ones
    requests = [kinds.build("describe", b"unused", f"what is {i}?", max_tokens=20 + 5 * i,
                            temperature=0, ignore_eos=True, **(penalties if i % 2 else {}))
                for i in range(4)]
    alone = []
    for image, request in zip(images, requests, strict=True):
        stats = GenerationStats()
        text = "".join(model.describe(image, request, stats))  # type: ignore[arg-type]
        alone.append((text, stats.finish_reason, stats.prompt_tokens, stats.completion_tokens))
    decoder = model.decoder()
    assert decoder is not None
    prepared = [model.prepare(im, r) for im, r in zip(images, requests, strict=True)]  # type: ignore[arg-type]
    together, _ = _run(decoder, {0: [(0, prepared[0]), (1, prepared[1])],
                                 4: [(2, prepared[2]), (3, prepared[3])]})
    assert together == dict(enumerate(alone))
    plain = msgspec.structs.replace(requests[1], sampling=msgspec.structs.replace(
        requests[1].sampling, repetition_penalty=1.0, frequency_penalty=0.0))
    assert "".join(model.describe(images[1], plain, GenerationStats())) != alone[1][0]  # type: ignore[arg-type]
    # A prompt longer than a prefill pass takes is still prefilled whole, image and all,
    # while text sequences run: chunks of its ids alone would leave the image out.
    decoder = model.decoder()
    assert decoder is not None
    decoder.least_prefill = 4
    decoder.prefill_budget = lambda: 4  # type: ignore[method-assign]
    assert all(p.prompt_tokens > 4 for p in prepared)
    together, _ = _run(decoder, {0: [(0, prepared[0])], 2: [(1, prepared[1])]})
    assert together == {0: alone[0], 1: alone[1]}


def test_models_that_cannot_batch_say_why() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    small: dict[str, Any] = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                             "num_hidden_layers": 2, "num_attention_heads": 2}
    with torch.random.fork_rng(devices=[]):
        llama = LlamaForCausalLM(LlamaConfig(**small))
        windowed = MistralForCausalLM(MistralConfig(sliding_window=8, **small))
    assert batch_fit.unsupported(llama) is None
    assert "sliding window" in (batch_fit.unsupported(windowed) or "")
    assert 1 <= batch_fit.default_max_sequences(llama) <= batch_fit.DEFAULT_MAX_SEQUENCES


def test_a_fast_model_prefills_more_at_once_and_most_when_nothing_runs(llm: CausalLM) -> None:
    decoder = llm.decoder()
    assert decoder is not None
    least = decoder.least_prefill
    assert decoder.prefill_budget() == least  # nothing measured yet
    first = [_request(i, max_tokens=30, ignore_eos=True) for i in range(2)]
    _run(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(first)]})
    assert decoder.token_s > 0 and decoder.step_s > 0
    assert decoder.prefill_budget() == batched_decode.IDLE_FACTOR * least  # none runs
    decoder.add(7, llm.prepare(_request(7, max_tokens=30, ignore_eos=True)))
    decoder.step()  # it runs now
    decoder.token_s, decoder.step_s = 0.001, 0.1  # a decode step costs 100 prompt tokens
    assert decoder.prefill_budget() == max(least, batched_decode.STALL_STEPS * 100)
    decoder.token_s = 1.0  # a slow model: never less than the least
    assert decoder.prefill_budget() == least
