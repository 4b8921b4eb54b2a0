"""Which waiting sequences the continuous decoder's next prefill pass takes.

A sequence here has `plain` (text only, no prompt logprobs: it may share a pass), `left`
(prompt tokens still to feed) and `fed` (fed already: from a kept prefix, or a long
prompt's earlier chunks). A pass takes the first waiting sequence and, when it is plain
and short, those behind it of the same sort, as many as `budget` padded tokens hold:
prompts from their start (one sent several times at once counted once: `prompt_key`
tells them apart), or rests of prompts fed up to a point. A prompt that is mostly
another's of the group waits for it: once that one's prompt is kept, the next pass
feeds only what follows the shared start, for all that waited so, together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from modelpool.registry.loaders.prefix_cache import MIN_REUSE_TOKENS

PromptKey = Callable[[Any], object]  # equal for prompts that one row prefills for all
SharedStart = Callable[[Any, Any], int]  # tokens two prompts share from their start, if
# the second may take them from the first's kept keys and values (0: it may not)


def next_group(waiting: Sequence[Any], budget: int, prompt_key: PromptKey,
               shared_start: SharedStart) -> list[Any]:
    first = waiting[0]
    if not first.plain or first.left > budget:
        return [first]
    # Rests (of prompts fed up to a point) go with rests, each in a row of its own; whole
    # prompts with whole prompts, one row for each distinct one.
    rests = bool(first.fed)
    key = (lambda seq: seq) if rests else prompt_key
    group, longest, prompts = [first], first.left, {key(first)}
    for seq in waiting[1:]:
        if not seq.plain or seq.left > budget or bool(seq.fed) != rests:
            continue
        prompt = key(seq)
        if prompt not in prompts:  # (one already in the group costs nothing more)
            if not rests and _waits_for_a_start(seq, group, shared_start):
                continue
            if (len(prompts) + 1) * max(longest, seq.left) > budget:
                break
            prompts.add(prompt)
        group.append(seq)
        longest = max(longest, seq.left)
    return group


def _waits_for_a_start(seq: Any, group: list[Any], shared_start: SharedStart) -> bool:
    """Whether most of the prompt is another's in the group: it waits for that one's
    kept keys and values, and then only its rest is fed (with the other rests)."""
    least = max(MIN_REUSE_TOKENS, seq.left // 2)
    return any(shared_start(other, seq) >= least for other in group)


def once_each(group: list[Any], prompt_key: PromptKey) -> tuple[list[Any], torch.Tensor]:
    """The group's distinct prompts, and for each sequence the row of its prompt among
    them."""
    first_of: dict[object, int] = {}
    unique, rows = [], []
    for seq in group:
        key = prompt_key(seq)
        if key not in first_of:
            first_of[key] = len(unique)
            unique.append(seq)
        rows.append(first_of[key])
    return unique, torch.tensor(rows)
