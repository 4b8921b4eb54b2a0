"""causal_lm.sample: greedy, temperature, top-k, the nucleus and min-p, on hand-made
probabilities."""

from __future__ import annotations

import torch

from modelpool.registry.loaders.causal_lm import sample


def test_sample_at_temperature_zero_is_argmax() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    generator = torch.Generator().manual_seed(0)
    assert {sample(logits, 0.0, 1.0, generator) for _ in range(20)} == {1}
    assert sample(logits, 0.0, 0.5, generator) == 1


def test_sample_at_a_vanishing_temperature_is_argmax_not_nan() -> None:
    """5e-324 is a valid temperature over HTTP: it must not make NaN probabilities."""
    logits = torch.tensor([1.0, 30.0, -5.0, 29.0])
    generator = torch.Generator().manual_seed(0)
    assert {sample(logits, 5e-324, 1.0, generator) for _ in range(10)} == {1}
    assert sample(logits, 2.3e-181, 0.5, generator) == 1


def _draws(probs: list[float], top_p: float = 1.0, n: int = 2000, top_k: int = 0,
           min_p: float = 0.0) -> set[int]:
    logits = torch.log(torch.tensor(probs))
    generator = torch.Generator().manual_seed(1234)
    return {sample(logits, 1.0, top_p, generator, top_k, min_p) for _ in range(n)}


def test_top_p_excludes_the_tail() -> None:
    assert _draws([0.5, 0.3, 0.2], top_p=1.0) == {0, 1, 2}
    assert _draws([0.5, 0.3, 0.2], top_p=0.6) == {0, 1}
    # Unsorted logits: the nucleus is chosen by probability, not by position.
    assert _draws([0.2, 0.5, 0.3], top_p=0.6) == {1, 2}
    assert _draws([0.2, 0.5, 0.3], top_p=1e-6) == {1}


def test_top_k_keeps_the_k_likeliest_and_the_nucleus_is_a_share_of_them() -> None:
    probs = [0.1, 0.4, 0.05, 0.3, 0.15]
    assert _draws(probs) == {0, 1, 2, 3, 4}
    assert _draws(probs, top_k=1) == {1}  # greedy at any temperature
    assert _draws(probs, top_k=3) == {1, 3, 4}
    assert _draws(probs, top_k=len(probs) + 5) == {0, 1, 2, 3, 4}
    # Of the top 2 (0.4 and 0.3: 4/7 and 3/7 once renormalized), a nucleus of 0.5 is the
    # first alone; of all five it would take both.
    assert _draws(probs, top_k=2, top_p=0.5) == {1}
    assert _draws(probs, top_p=0.5) == {1, 3}


def test_min_p_leaves_out_what_is_less_likely_than_its_share_of_the_likeliest() -> None:
    probs = [0.1, 0.4, 0.05, 0.3, 0.15]
    assert _draws(probs, min_p=0.3) == {1, 3, 4}  # at least 0.12
    assert _draws(probs, min_p=0.5) == {1, 3}  # at least 0.2
    assert _draws(probs, min_p=1.0) == {1}


# ---- IncrementalDecoder ----------------------------------------------------------------
