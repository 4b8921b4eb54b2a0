"""An output token's log-probability and the likeliest alternatives at its place, for a
sequence whose sampling asks for logprobs. Taken from the model's raw logits, before
biases, penalties, temperature and the cuts (vLLM's default): what the model thinks of
the token, not how this request's sampling treated it. A sequence that does not ask pays
nothing. A token the model rules out (-inf) is reported at FLOOR, as vLLM does: JSON has
no infinity."""

from __future__ import annotations

from typing import Any

import torch

from modelpool.protocol.messages import TokenLogprob, TopLogprob

FLOOR = -9999.0


def token_logprob(logits: torch.Tensor, token: int, top: int, tokenizer: Any) -> TokenLogprob:
    """The token's entry from its row of raw logits (float32), with the `top` likeliest
    tokens, likeliest first; each token's text as the tokenizer decodes it alone."""
    logprobs = torch.log_softmax(logits, dim=-1).clamp(min=FLOOR)
    likeliest: list[TopLogprob] = []
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
        likeliest = [TopLogprob(_text(tokenizer, i), v)
                     for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprob(_text(tokenizer, token), token, float(logprobs[token]), likeliest)


def _text(tokenizer: Any, token: int) -> str:
    # Alone, a token holding part of a character decodes to U+FFFD, as in vLLM's output.
    return str(tokenizer.decode([token], skip_special_tokens=False))
