"""Prompts' KV caches kept for the next request that starts the same way (prefix caching).

A chat sends its whole conversation again at every turn, and many applications start
every prompt with the same long system prompt or few-shot examples: without this, each
request prefills all of it again, which on a CPU costs about as much as a few decode
steps per 128 tokens. The decoder keeps each sequence's keys and values, its prompt's
when it is prefilled and the prompt's with its output when it ends, under the token ids
they hold; a new prompt takes the longest prefix one entry holds and is prefilled from
there. Entries are kept within a byte budget, the least recently used dropped first; an
entry that another extends is dropped for it. A request's cache salt (vLLM's
`cache_salt`) keeps it to entries of the same salt. The cached values are the ones the same
tokens would get again, up to floating-point rounding (as in vLLM's prefix caching).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

# A prefix shorter than this is prefilled again: reuse saves less than it costs to look up
# and copy, and tiny entries would crowd the budget.
MIN_REUSE_TOKENS = 16

# No memory for a copy: the cache is a saving, its sequences go on without it (prefilled
# whole) rather than fail.
COPY_FAILED = (MemoryError, RuntimeError)

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, heads, n, dim)


@dataclass(eq=False)
class _Entry:
    ids: torch.Tensor  # the token ids its keys and values hold, 1-D, on the CPU
    salt: str  # only prompts of the same salt may take it
    layers: Layers
    nbytes: int


class PrefixCache:
    """One model's kept prefixes (single-threaded: its decoder's loop owns it)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: list[_Entry] = []  # least recently used first
        self.nbytes = 0

    def take(self, ids: torch.Tensor, salt: str) -> tuple[int, DynamicCache | None]:
        """A cache holding the longest prefix of `ids` (1-D) kept under the same salt,
        and its length: at most all but the last token, whose logits the model must still
        compute; (0, None) when none is at least MIN_REUSE_TOKENS long. The cache is the
        caller's own."""
        ids = ids.cpu()
        length, best = 0, None
        for entry in self.entries:
            shared = shared_prefix(entry.ids, ids) if entry.salt == salt else 0
            if shared > length:
                length, best = shared, entry
        length = min(length, len(ids) - 1)
        if best is None or length < MIN_REUSE_TOKENS:
            return 0, None
        self._touch(best)
        try:  # copied (DynamicLayer.update concatenates): the entry stays as it is
            return length, DynamicCache(ddp_cache_data=[
                (keys[:, :, :length], values[:, :, :length]) for keys, values in best.layers])
        except COPY_FAILED:
            return 0, None

    def keep(self, ids: torch.Tensor, salt: str, layers_of: Callable[[], Layers]) -> None:
        """Keep the keys and values of these token ids under `salt`: `layers_of` makes
        them (batch 1, their own memory), when no entry of that salt holds them already."""
        ids = ids.cpu()
        if len(ids) < MIN_REUSE_TOKENS:
            return
        mine = [e for e in self.entries if e.salt == salt]
        for entry in mine:
            if shared_prefix(entry.ids, ids) == len(ids):  # as long or longer: it has these
                self._touch(entry)
                return
        try:
            layers = layers_of()
        except COPY_FAILED:
            return
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget_bytes:
            return
        for entry in [e for e in mine if shared_prefix(e.ids, ids) == len(e.ids)]:
            self._remove(entry)
        self.entries.append(_Entry(ids, salt, layers, nbytes))
        self.nbytes += nbytes
        while self.nbytes > self.budget_bytes:
            self._remove(self.entries[0])

    def _touch(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        self.entries.append(entry)

    def _remove(self, entry: _Entry) -> None:
        self.entries.remove(entry)
        self.nbytes -= entry.nbytes


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens a and b (1-D) have in common from their start."""
    n = min(len(a), len(b))
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
