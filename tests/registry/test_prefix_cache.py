"""Kept prefixes: the longest one a prompt starts with, within a byte budget."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from modelpool.protocol import kinds
from modelpool.protocol.messages import Generate
from modelpool.registry.loaders import batched_decode, causal_lm, prefix_cache
from modelpool.registry.loaders.batched_decode import ContinuousDecoder
from modelpool.registry.loaders.causal_lm import CausalLM
from modelpool.registry.loaders.common import kv_cache_of
from modelpool.registry.loaders.prefix_cache import MIN_REUSE_TOKENS, PrefixCache
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats

LAYERS = 2


def _layers(ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values that say which token they are: (1, 1 head, n, 1), as floats."""
    column = ids.to(torch.float32)[None, None, :, None]
    return [(column + layer, -(column + layer)) for layer in range(LAYERS)]


def _ids(*runs: tuple[int, int]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in runs])


def _keep(cache: PrefixCache, ids: torch.Tensor) -> None:
    cache.keep(ids, "", lambda: _layers(ids))


def _not_copied() -> list[tuple[torch.Tensor, torch.Tensor]]:
    raise AssertionError("keys and values copied for tokens an entry holds already")


def _entry_bytes(n: int) -> int:
    return 2 * LAYERS * n * 4


def test_a_prompt_takes_the_longest_kept_prefix_and_computes_its_last_token() -> None:
    cache = PrefixCache(1 << 20)
    _keep(cache, _ids((0, 40)))
    _keep(cache, _ids((0, 20), (500, 530)))
    prompt = _ids((0, 20), (500, 520), (900, 910))
    length, got = cache.take(prompt, "")
    assert length == 40 and got is not None
    assert torch.equal(got.layers[1].keys[0, 0, :, 0], prompt[:40].float() + 1)
    assert torch.equal(got.layers[1].values[0, 0, :, 0], -(prompt[:40].float() + 1))
    # The whole prompt kept: all but its last token, whose logits are still needed.
    length, got = cache.take(_ids((0, 40)), "")
    assert length == 39 and got is not None and got.get_seq_length() == 39


def test_short_prefixes_are_neither_kept_nor_taken() -> None:
    cache = PrefixCache(1 << 20)
    _keep(cache, _ids((0, MIN_REUSE_TOKENS - 1)))
    assert cache.entries == []
    _keep(cache, _ids((0, 40)))
    assert cache.take(_ids((0, MIN_REUSE_TOKENS - 1), (700, 720)), "") == (0, None)
    assert cache.take(_ids((0, MIN_REUSE_TOKENS), (700, 720)), "")[0] == MIN_REUSE_TOKENS
    assert cache.take(_ids((1, 60)), "") == (0, None)  # nothing in common from the start


def test_what_is_taken_is_a_copy_the_entry_outlives() -> None:
    cache = PrefixCache(1 << 20)
    _keep(cache, _ids((0, 40)))
    _, got = cache.take(_ids((0, 50)), "")
    assert got is not None
    got.layers[0].keys.fill_(7.0)
    got.update(torch.zeros(1, 1, 3, 1), torch.zeros(1, 1, 3, 1), 0)
    _, again = cache.take(_ids((0, 50)), "")
    assert again is not None and again.get_seq_length() == 40
    assert torch.equal(again.layers[0].keys[0, 0, :, 0], _ids((0, 40)).float())


def test_an_entry_extending_another_replaces_it_and_one_contained_adds_nothing() -> None:
    cache = PrefixCache(1 << 20)
    _keep(cache, _ids((0, 30)))
    _keep(cache, _ids((0, 50)))  # a conversation's next turn
    assert [len(e.ids) for e in cache.entries] == [50]
    cache.keep(_ids((0, 40)), "", _not_copied)  # held already
    assert [len(e.ids) for e in cache.entries] == [50]
    assert cache.nbytes == _entry_bytes(50)


def test_prompts_of_another_salt_take_nothing_kept_under_one() -> None:
    cache = PrefixCache(1 << 20)
    cache.keep(_ids((0, 40)), "tenant-a", lambda: _layers(_ids((0, 40))))
    assert cache.take(_ids((0, 50)), "") == (0, None)
    assert cache.take(_ids((0, 50)), "tenant-b") == (0, None)
    assert cache.take(_ids((0, 50)), "tenant-a")[0] == 40
    cache.keep(_ids((0, 30)), "tenant-b", lambda: _layers(_ids((0, 30))))  # its own copy
    assert [(e.salt, len(e.ids)) for e in cache.entries] == [("tenant-a", 40), ("tenant-b", 30)]


def test_the_least_recently_used_go_first_when_the_budget_is_full() -> None:
    cache = PrefixCache(3 * _entry_bytes(20))
    for start in (0, 100, 200):
        _keep(cache, _ids((start, start + 20)))
    assert cache.take(_ids((0, 20), (999, 1000)), "")[0] == 20  # used: now the most recent
    _keep(cache, _ids((300, 320)))
    assert sorted(int(e.ids[0]) for e in cache.entries) == [0, 200, 300]
    assert cache.nbytes == 3 * _entry_bytes(20)
    _keep(cache, _ids((400, 481)))  # over the whole budget
    assert sorted(int(e.ids[0]) for e in cache.entries) == [0, 200, 300]


def test_a_lookup_compares_a_few_entries_however_many_are_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of answers to one prompt kept (each its prompt and its own output): a
    prompt is compared token by token with at most CANDIDATES of them, found by its
    blocks, and still takes the longest prefix; an entry it extends is still found."""
    cache = PrefixCache(1 << 30)
    prompt = _ids((0, 40))
    for answer in range(2000):
        _keep(cache, torch.cat([prompt, torch.tensor([10_000 + answer, 7])]))
    compared = []
    real = prefix_cache._common
    monkeypatch.setattr(prefix_cache, "_common", lambda a, b: compared.append(1) or real(a, b))
    assert cache.take(torch.cat([prompt, torch.tensor([10_500, 7, 3])]), "")[0] == 42
    assert cache.take(torch.cat([prompt, torch.tensor([5])]), "")[0] == 40
    assert len(compared) <= 2 * prefix_cache.CANDIDATES
    _keep(cache, torch.cat([prompt, torch.tensor([10_500, 7, 3])]))  # extends one
    assert len(cache.entries) == 2000
    assert cache.take(torch.cat([prompt, torch.tensor([10_500, 7, 3, 9])]), "")[0] == 43


# ---- through the continuous decoder, with the tiny model ---------------------------------

SHARED = "You are a tiny model and you answer in tiny words. " * 3


def _generate(prompt: str | list[int], **fields: Any) -> Generate:
    defaults: dict[str, Any] = {"max_tokens": 12, "temperature": 0, "raw": True,
                                "ignore_eos": True}
    request = kinds.build("generate", prompt, **{**defaults, **fields})
    assert isinstance(request, Generate)
    return request


def _alone(llm: CausalLM, request: Generate) -> tuple[str, int]:
    return "".join(llm.generate(request, GenerationStats())), 0


def _decoded(decoder: ContinuousDecoder, arrivals: dict[int, list[tuple[int, Any]]]
             ) -> dict[int, tuple[str, int]]:
    """Each sequence's text and cached prompt tokens; arrivals[step] join before it."""
    texts: dict[int, str] = {}
    ended: dict[int, tuple[str, int]] = {}
    step = 0
    while len(decoder) or any(s >= step for s in arrivals):
        for seq_id, prepared in arrivals.get(step, []):
            decoder.add(seq_id, prepared)
        for event in decoder.step():
            assert event.error is None
            texts[event.seq_id] = texts.get(event.seq_id, "") + event.text
            if event.stats is not None:
                ended[event.seq_id] = (texts[event.seq_id], event.stats.cached_tokens)
        step += 1
        assert step < 1_000
    return ended


def _shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def test_a_prompt_starting_as_a_running_one_is_prefilled_from_its_keys_and_values(
        llm: CausalLM) -> None:
    first = _generate(SHARED + "Tell me about rivers.", max_tokens=30)
    second = _generate(SHARED + "Tell me about trees and the hills.")
    decoder = llm.decoder()
    assert decoder is not None and decoder.prefix_cache is not None
    got = _decoded(decoder, {0: [(1, llm.prepare(first))], 3: [(2, llm.prepare(second))]})
    common = _shared(llm.prompt_ids(first), llm.prompt_ids(second))
    assert common >= 30
    assert got == {1: _alone(llm, first), 2: (_alone(llm, second)[0], common)}


def test_a_conversations_next_turn_reuses_the_last_turns_output_too(llm: CausalLM) -> None:
    ids = llm.prompt_ids(_generate(SHARED + "Once upon a time"))
    output = _greedy(llm, ids, 10)
    turn = _generate(ids, max_tokens=10)
    next_turn = _generate(ids + output + ids[:5], max_tokens=8)
    decoder = llm.decoder()
    assert decoder is not None
    got = _decoded(decoder, {0: [(1, llm.prepare(turn))]})
    got.update(_decoded(decoder, {0: [(2, llm.prepare(next_turn))]}))
    # Its keys and values hold the prompt and the output but the last token, never fed.
    assert got == {1: _alone(llm, turn),
                   2: (_alone(llm, next_turn)[0], len(ids) + len(output) - 1)}


def test_what_follows_a_kept_prefix_is_fed_in_chunks_when_long(llm: CausalLM) -> None:
    first = _generate(SHARED + "Hello.", max_tokens=2)
    long = _generate(SHARED + "tiny model " * 300, max_tokens=6)
    decoder = llm.decoder()
    assert decoder is not None
    decoder.prefill_budget = lambda: decoder.least_prefill  # type: ignore[method-assign]
    prepared = llm.prepare(long)
    assert prepared.prompt_tokens > 3 * decoder.least_prefill
    got = _decoded(decoder, {0: [(1, llm.prepare(first))], 4: [(2, prepared)]})
    common = _shared(llm.prompt_ids(first), llm.prompt_ids(long))
    assert got[2] == (_alone(llm, long)[0], common)


def test_prompts_waiting_together_take_what_the_one_before_them_left(
        llm: CausalLM) -> None:
    """Long prompts arriving at once are prefilled one after another (in chunks): each
    waiting one is looked up again at each prefill, so the second starts where the
    first's prompt is kept."""
    first = _generate(SHARED * 3 + "rivers " * 40, max_tokens=4)
    second = _generate(SHARED * 3 + "trees " * 40, max_tokens=4)
    decoder = llm.decoder()
    assert decoder is not None
    decoder.prefill_budget = lambda: decoder.least_prefill  # type: ignore[method-assign]
    got = _decoded(decoder, {0: [(1, llm.prepare(first)), (2, llm.prepare(second))]})
    common = _shared(llm.prompt_ids(first), llm.prompt_ids(second))
    assert common >= 100 and all(len(llm.prompt_ids(r)) > decoder.least_prefill
                                 for r in (first, second))  # each prefilled alone
    assert got == {1: _alone(llm, first), 2: (_alone(llm, second)[0], common)}


def test_no_prefix_is_kept_with_prefix_cache_mb_0(llm: CausalLM,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm, "prefix_cache_bytes", 0)
    decoder = llm.decoder()
    assert decoder is not None and decoder.prefix_cache is None
    request = _generate(SHARED + "Tell me about rivers.")
    got = _decoded(decoder, {0: [(1, llm.prepare(request))], 2: [(2, llm.prepare(request))]})
    assert got == {1: _alone(llm, request), 2: _alone(llm, request)}


@pytest.mark.parametrize("value", [-1, 1.5, True, "64"])
def test_prefix_cache_mb_must_be_a_whole_number_of_mib(value: Any) -> None:
    spec = ModelSpec(key="m", capability="text_to_text", path="/m",
                     options={"prefix_cache_mb": value})
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        causal_lm._prefix_cache_bytes(spec)
    assert causal_lm._prefix_cache_bytes(msgspec.structs.replace(
        spec, options={"prefix_cache_mb": 64})) == 64 << 20


def _greedy(llm: CausalLM, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = llm.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_no_memory_for_a_copy_leaves_the_sequences_running(
        llm: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*_: Any) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(batched_decode, "row_of", no_memory)
    request = _generate(SHARED + "Tell me about rivers.")
    decoder = llm.decoder()
    assert decoder is not None and decoder.prefix_cache is not None
    got = _decoded(decoder, {0: [(1, llm.prepare(request))], 2: [(2, llm.prepare(request))]})
    assert got == {1: _alone(llm, request), 2: _alone(llm, request)}
    assert decoder.prefix_cache.entries == []


class _Passes:
    """The model, counting the rows of each forward pass's input."""

    def __init__(self, model: Any) -> None:
        self.model, self.rows = model, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, **inputs: Any) -> Any:
        self.rows.append(int(inputs["input_ids"].shape[0]))
        return self.model(**inputs)


@pytest.mark.parametrize("cache_on", [True, False])
def test_a_prompt_sent_several_times_at_once_is_prefilled_once(
        llm: CausalLM, monkeypatch: pytest.MonkeyPatch, cache_on: bool) -> None:
    """A request's n choices reach the decoder as n sequences of one prompt: one row of
    the prefill, copied to each; each then samples on its own. Another salt's copy is a
    prompt of its own, and with the prefix cache off nothing is shared."""
    if not cache_on:
        monkeypatch.setattr(llm, "prefix_cache_bytes", 0)
    choices = [_generate(SHARED + "Tell me about rivers.", temperature=1.0, seed=seed,
                         ignore_eos=True, max_tokens=6) for seed in range(4)]
    salted = _generate(SHARED + "Tell me about rivers.", cache_salt="b")
    other = _generate("A prompt of its own, and short.")
    decoder = llm.decoder()
    assert decoder is not None and (decoder.prefix_cache is not None) is cache_on
    decoder.prefill_budget = lambda: 1024  # type: ignore[method-assign]  # (idle's)
    passes = _Passes(llm.model)
    decoder.model = passes
    arrivals = [(i, llm.prepare(r)) for i, r in enumerate([*choices, salted, other])]
    got = _decoded(decoder, {0: arrivals})
    assert passes.rows[0] == (3 if cache_on else 6)  # the first pass: the prefill
    assert passes.rows[1] == 6  # then all six decode together
    assert got == {i: _alone(llm, r) for i, r in enumerate([*choices, salted, other])}
    assert len({got[i][0] for i in range(4)}) > 1  # each choice sampled on its own


@pytest.mark.parametrize("fit_together", [False, True])
def test_prompts_waiting_with_one_start_have_their_rests_fed_in_one_pass(
        llm: CausalLM, fit_together: bool) -> None:
    """Requests arriving together with the same instructions: the first is prefilled, and
    the others, each taking its kept prompt, are fed what follows in one pass, rests of
    different lengths together (not one pass each between decode steps), also when all
    would fit one pass whole (which would compute the shared start for each)."""
    questions = ["Tell me about rivers.", "And trees?", "What of the hills, the sea and "
                 "the long roads between the towns?"]
    requests = [_generate(SHARED * 2 + q, max_tokens=5) for q in questions]
    decoder = llm.decoder()
    assert decoder is not None
    budget = 8 * decoder.least_prefill if fit_together else decoder.least_prefill
    decoder.prefill_budget = lambda: budget  # type: ignore[method-assign]
    lengths = [len(llm.prompt_ids(r)) for r in requests]
    assert all(decoder.least_prefill // 2 < n <= decoder.least_prefill for n in lengths)
    passes = _Passes(llm.model)
    decoder.model = passes
    got = _decoded(decoder, {0: [(i, llm.prepare(r)) for i, r in enumerate(requests)]})
    common = [_shared(llm.prompt_ids(requests[0]), llm.prompt_ids(r)) for r in requests]
    assert got == {i: (_alone(llm, r)[0], common[i] if i else 0)
                   for i, r in enumerate(requests)}
    assert passes.rows[:3] == [1, 1, 2]  # the first's prompt, its decode, both rests
    # What was kept of each (its prompt and output) is what the tokens alone would give.
    assert len(decoder.prefix_cache.entries) == 3
    for entry in decoder.prefix_cache.entries:
        with torch.inference_mode():
            alone = kv_cache_of(llm.model(input_ids=entry.ids[None], use_cache=True))
        for (keys, values), layer in zip(entry.layers, alone.layers, strict=True):
            torch.testing.assert_close(keys, layer.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values, layer.values, atol=1e-4, rtol=1e-4)
