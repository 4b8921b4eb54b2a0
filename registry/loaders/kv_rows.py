"""The running sequences of a continuous batch and their shared KV cache, left-padded."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from modelpool.registry.loaders.prefix_cache import Layers


class Rows:
    """Row i of the cache is seqs[i]. Each row's real tokens are its last columns: a row
    joins left-padded to the batch's length and every step adds a column to all."""

    def __init__(self) -> None:
        self.seqs: list[Any] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # 1: a real token
        self.positions = torch.zeros(0, dtype=torch.long)  # each row's next position

    def join(self, seqs: list[Any], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add sequences whose prompts are in `cache` (rows in order, left-padded)."""
        _zero_padding(cache, mask)
        positions = mask.sum(dim=1)
        if self.cache is None:
            self.seqs, self.cache, self.mask, self.positions = list(seqs), cache, mask, positions
            return
        length = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([left_pad_kv(mine.keys, length),
                                   left_pad_kv(theirs.keys, length)])
            mine.values = torch.cat([left_pad_kv(mine.values, length),
                                     left_pad_kv(theirs.values, length)])
        self.mask = torch.cat([_pad_mask(self.mask, length), _pad_mask(mask, length)])
        self.positions = torch.cat([self.positions, positions])
        self.seqs.extend(seqs)

    def keep(self, rows: list[int]) -> None:
        """Only these rows stay; columns that are padding in every row left go too."""
        if not rows:
            self.seqs, self.cache = [], None
            self.mask, self.positions = self.mask[:0, :0], self.positions[:0]
            return
        if len(rows) == len(self.seqs):
            return
        assert self.cache is not None
        index = torch.tensor(rows)
        mask = self.mask[index]
        start = int(mask.any(dim=0).int().argmax())  # first column some row still uses
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        self.mask, self.positions = mask[:, start:], self.positions[index]
        self.seqs = [self.seqs[i] for i in rows]

    def real_tokens(self, row: int) -> int:
        """How many of the row's last columns are its tokens (the rest is padding)."""
        return int(self.positions[row])


def row_of(cache: DynamicCache, row: int, tokens: int) -> Layers:
    """A row's last `tokens` keys and values (its real ones, left-padded), copied."""
    return [(layer.keys[row:row + 1, :, -tokens:].clone(),
             layer.values[row:row + 1, :, -tokens:].clone()) for layer in cache.layers]


def left_pad_kv(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, 0, length - t.shape[-2], 0))


def _pad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(mask, (length - mask.shape[1], 0))


def _zero_padding(cache: DynamicCache, mask: torch.Tensor) -> None:
    """Padding's keys and values become zeros: masked out, they must not be NaN either
    (a query that sees only padding makes NaN, and 0 x NaN is NaN)."""
    if bool(mask.all()):
        return
    keep = mask.bool()[:, None, :, None].to(cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys = torch.where(keep, layer.keys, 0.0)
        layer.values = torch.where(keep, layer.values, 0.0)
