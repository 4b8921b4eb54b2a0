"""Prompts' KV caches kept for the next request that starts the same way (prefix caching).

A chat sends its whole conversation again at every turn, and many applications start
every prompt with the same long system prompt or few-shot examples: without this, each
request prefills all of it again, which on a CPU costs about as much as a few decode
steps per 128 tokens. The decoder keeps each sequence's keys and values, its prompt's
when it is prefilled and the prompt's with its output when it ends, under the token ids
they hold; a new prompt takes the longest prefix one entry holds and is prefilled from
there. Entries are found by their whole blocks of 16 tokens, each hashed with all before
it (as vLLM's blocks are), and by the hash of all they hold: a lookup compares a few of
them with the prompt however many are kept. Entries are kept within a byte budget, the
least recently used dropped first; an entry that another extends is dropped for it. A
request's cache salt (vLLM's `cache_salt`) keeps it to entries of the same salt. The
cached values are the ones the same tokens would get again, up to floating-point rounding
(as in vLLM's prefix caching).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

# A prefix shorter than this is prefilled again: reuse saves less than it costs to look up
# and copy, and tiny entries would crowd the budget.
MIN_REUSE_TOKENS = 16
# Entries are found by their whole blocks of this many tokens (each hashed with all before
# it and the salt), not by comparing a prompt with every entry: with thousands kept (a
# small model's are small) that scan took most of a short request's time in its worker.
BLOCK_TOKENS = MIN_REUSE_TOKENS
# At most this many entries holding a prompt's last matched block are compared with it
# token by token, the most recently kept first.
CANDIDATES = 32

# No memory for a copy: the cache is a saving, its sequences go on without it (prefilled
# whole) rather than fail.
COPY_FAILED = (MemoryError, RuntimeError)

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values (1, heads, n, dim)
Members = dict["_Entry", None]  # entries in the order they were kept


@dataclass(eq=False)
class _Entry:
    salt: str  # only prompts of the same salt may take it
    layers: Layers
    nbytes: int
    raw: bytes  # the token ids its keys and values hold, as int64 bytes
    chain: list[int]  # its whole blocks' hashes

    @property
    def ids(self) -> torch.Tensor:
        """Its token ids, 1-D, on the CPU."""
        return torch.frombuffer(bytearray(self.raw), dtype=torch.int64)


class PrefixCache:
    """One model's kept prefixes (single-threaded: its decoder's loop owns it)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # least recently used first
        self._holding: dict[int, Members] = {}  # by block hash: the entries holding it
        self._whole: dict[int, Members] = {}  # by _whole_hash: the entries of those ids
        self.nbytes = 0

    @property
    def entries(self) -> list[_Entry]:
        """The kept entries, least recently used first."""
        return list(self._lru)

    def take(self, ids: torch.Tensor, salt: str) -> tuple[int, DynamicCache | None]:
        """A cache holding the longest prefix of `ids` (1-D) kept under the same salt,
        and its length: at most all but the last token, whose logits the model must still
        compute; (0, None) when none is at least MIN_REUSE_TOKENS long. The cache is the
        caller's own."""
        raw, chain = _key(ids, salt)
        depth = 0
        while depth < len(chain) and chain[depth] in self._holding:
            depth += 1
        length, best = 0, None
        if depth:
            for entry in _recent(self._holding[chain[depth - 1]]):
                shared = _common(entry.raw, raw) if entry.salt == salt else 0
                if shared > length:
                    length, best = shared, entry
                if length >= len(raw) // 8 - 1:
                    break
            contained = self._contained(raw, salt, chain[depth - 1], depth * BLOCK_TOKENS,
                                        length)
            if contained is not None:
                length, best = len(contained.raw) // 8, contained
        length = min(length, len(raw) // 8 - 1)
        if best is None or length < MIN_REUSE_TOKENS:
            return 0, None
        self._lru.move_to_end(best)
        try:  # copied (DynamicLayer.update concatenates): the entry stays as it is
            return length, DynamicCache(ddp_cache_data=[
                (keys[:, :, :length], values[:, :, :length]) for keys, values in best.layers])
        except COPY_FAILED:
            return 0, None

    def _contained(self, raw: bytes, salt: str, block: int, start: int, longer_than: int
                   ) -> _Entry | None:
        """The longest entry that `raw` starts with, past its whole blocks (up to `start`
        tokens, the last hashed `block`) by less than a block, if longer than
        `longer_than` tokens: a conversation's turn before, among the many other answers
        to the same start that the blocks alone do not tell apart."""
        tokens = len(raw) // 8
        for end in range(min(tokens, start + BLOCK_TOKENS - 1), max(start, longer_than), -1):
            for entry in self._holding_exactly(raw, salt, block, start, end):
                return entry
        return None

    def _holding_exactly(self, raw: bytes, salt: str, block: int, start: int,
                         end: int) -> list[_Entry]:
        """The entries holding exactly the first `end` tokens of `raw`, whose last whole
        block (ending at `start`) hashed to `block`."""
        members = self._whole.get(hash((block, raw[8 * start:8 * end])), {})
        return [e for e in members if e.salt == salt and e.raw == raw[:8 * end]]

    def keep(self, ids: torch.Tensor, salt: str, layers_of: Callable[[], Layers]) -> None:
        """Keep the keys and values of these token ids under `salt`: `layers_of` makes
        them (batch 1, their own memory), when no entry of that salt holds them already."""
        if len(ids) < MIN_REUSE_TOKENS:
            return
        raw, chain = _key(ids, salt)
        for entry in _recent(self._holding.get(chain[-1], {})):
            if entry.salt == salt and entry.raw[:len(raw)] == raw:  # it has these
                self._lru.move_to_end(entry)
                return
        try:
            layers = layers_of()
        except COPY_FAILED:
            return
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.budget_bytes:
            return
        for entry in self._extended_by(raw, chain, salt):
            self._remove(entry)
        self._add(_Entry(salt, layers, nbytes, raw, chain))
        while self.nbytes > self.budget_bytes:
            self._remove(next(iter(self._lru)))

    def _extended_by(self, raw: bytes, chain: list[int], salt: str) -> list[_Entry]:
        """The entries whose ids `raw` starts with: found by their whole content's hash,
        at each of its lengths past a whole block."""
        tokens = len(raw) // 8
        return [entry for depth, block in enumerate(chain, 1)
                for end in range(depth * BLOCK_TOKENS, min((depth + 1) * BLOCK_TOKENS,
                                                           tokens + 1))
                for entry in self._holding_exactly(raw, salt, block, depth * BLOCK_TOKENS,
                                                   end)]

    def _add(self, entry: _Entry) -> None:
        self._lru[entry] = None
        for block in entry.chain:
            self._holding.setdefault(block, {})[entry] = None
        self._whole.setdefault(_whole_hash(entry), {})[entry] = None
        self.nbytes += entry.nbytes

    def _remove(self, entry: _Entry) -> None:
        del self._lru[entry]
        for block, index in [*((b, self._holding) for b in entry.chain),
                             (_whole_hash(entry), self._whole)]:
            members = index[block]
            members.pop(entry, None)
            if not members:
                del index[block]
        self.nbytes -= entry.nbytes


def _key(ids: torch.Tensor, salt: str) -> tuple[bytes, list[int]]:
    """Token ids as int64 bytes, and the hash of each whole block with all before it
    (bytes' hashes are seeded per process: no client can aim a collision; every match is
    checked token by token anyway)."""
    raw = ids.detach().to(device="cpu", dtype=torch.int64).numpy().tobytes()
    step = 8 * BLOCK_TOKENS
    chain, value = [], hash(salt)
    for start in range(0, len(raw) - step + 1, step):
        value = hash((value, raw[start:start + step]))
        chain.append(value)
    return raw, chain


def _whole_hash(entry: _Entry) -> int:
    """Its last whole block's hash with the tokens after it (what _holding_exactly
    looks up)."""
    start = 8 * BLOCK_TOKENS * len(entry.chain)
    return hash((entry.chain[-1], entry.raw[start:]))


def _recent(members: Members) -> list[_Entry]:
    return list(itertools.islice(reversed(members), CANDIDATES))


def _common(a: bytes, b: bytes) -> int:
    """How many tokens two runs of int64 bytes have in common from their start."""
    n = min(len(a), len(b)) // 8
    if a[:8 * n] == b[:8 * n]:
        return n
    low, high = 0, n  # equal up to low tokens, not up to high
    while high - low > 1:
        middle = (low + high) // 2
        if a[:8 * middle] == b[:8 * middle]:
            low = middle
        else:
            high = middle
    return low


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens a and b (1-D) have in common from their start."""
    n = min(len(a), len(b))
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
