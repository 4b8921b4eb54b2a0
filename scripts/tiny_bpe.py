"""A small, deterministic BPE merge learner for the tiny CLIP tokenizer.

Kept apart from make_tiny_models.py: it is an algorithm, not a model builder.
"""

from __future__ import annotations

import itertools
from collections import Counter


def learn_bpe_merges(words: Counter[tuple[str, ...]], count: int) -> list[tuple[str, str]]:
    """Classic BPE: merge the most frequent adjacent pair, `count` times.

    Ties go to the smallest pair, so every run learns the same merges. (The tokenizers
    trainer breaks ties by symbol ids, which with an end-of-word suffix follow hash-map
    order and change from run to run.)"""
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for pair in itertools.pairwise(symbols):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        # Distinct words stay distinct after a merge, so no counts are lost here.
        words = Counter({_merge(symbols, best): n for symbols, n in words.items()})
    return merges


def _merge(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if symbols[i : i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)
