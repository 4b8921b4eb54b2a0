"""Several prompts that each start from keys and values of their own (a kept prefix, or a
long prompt's earlier chunks), the rest of each fed in one forward pass.

Requests that arrive together with the same instructions and their own questions each
take the first one's kept prompt: fed one by one, each rest cost a forward pass of its
own between two decode steps, so the last of n waited about 2n passes for its first
token. Together, one pass feeds them all. The batch is laid out as a decode step's:
each row's cached keys and values right-aligned (left-padded), then its rest, also
left-padded, so that every row's last column is its last prompt token. That leaves
padding between a shorter rest and its cache; after the pass each row's padding columns
are moved to its left (`left_aligned`), so that the rows join the running batch with
their real tokens last, as every row there has them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from modelpool.registry.loaders.kv_rows import left_pad_kv


def batch_of(caches: list[DynamicCache], lengths: list[int]
             ) -> tuple[DynamicCache, torch.Tensor]:
    """One cache of these batch-1 caches (each holding `lengths[i]` tokens), each row
    left-padded with zeros to the longest, and its mask (1: a real token)."""
    width = max(lengths)
    layers = []
    for per_layer in zip(*(cache.layers for cache in caches), strict=True):
        layers.append((torch.cat([left_pad_kv(layer.keys, width) for layer in per_layer]),
                       torch.cat([left_pad_kv(layer.values, width) for layer in per_layer])))
    mask = torch.zeros((len(caches), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    return DynamicCache(ddp_cache_data=layers), mask


def left_padded(rests: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (1-D each) as one left-padded batch, and its mask."""
    width = max(len(rest) for rest in rests)
    ids = torch.full((len(rests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rests), width), dtype=torch.long)
    for row, rest in enumerate(rests):
        ids[row, width - len(rest):] = rest.cpu()
        mask[row, width - len(rest):] = 1
    return ids, mask


def positions_after(lengths: list[int], mask: torch.Tensor) -> torch.Tensor:
    """Each new column's position: row i's first real one follows its `lengths[i]` cached
    tokens (padding columns get a position too; they are masked out)."""
    return (torch.tensor(lengths)[:, None] + mask.cumsum(-1) - 1).clamp(min=0)


def left_aligned(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Move each row's padding columns to its left, real tokens keeping their order (a
    key carries its position in itself: where its column sits changes nothing); columns
    that are padding in every row go. Returns the new mask; the cache is changed in place."""
    order = torch.argsort(mask, dim=1, stable=True)  # padding (0) first, in order
    mask = mask.gather(1, order)
    start = int(mask.any(dim=0).int().argmax())
    order, mask = order[:, start:], mask[:, start:]
    for layer in cache.layers:
        index = order[:, None, :, None].to(layer.keys.device)
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1,
                                                       layer.keys.shape[3]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1,
                                                           layer.values.shape[3]))
    return mask
