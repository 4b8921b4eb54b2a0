"""An output token's log-probability and the likeliest alternatives at its place, for a
sequence whose sampling asks for logprobs (and each prompt token's, for prompt_logprobs:
the prompt's pass then keeps the logits of every position, not only the last). From
the model's raw logits, before
biases, penalties, temperature and the cuts (vLLM's default): what the model thinks of
the token, not how this request's sampling treated it. A sequence that does not ask pays
nothing. A token the model rules out (-inf) is reported at FLOOR, as vLLM does: JSON has
no infinity."""

from __future__ import annotations

from typing import Any

import torch

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Sampling, TokenLogprob, TopLogprob

FLOOR = -9999.0
# The prompt's logits that prompt_logprobs may hold at once (its tokens x the vocabulary,
# float32): a longer prompt is refused, not left to take the worker's memory.
PROMPT_LOGITS_BYTES = 256 * 1024 * 1024


def check_prompt_logprobs(sampling: Sampling, prompt_tokens: int, vocab: int | None,
                          key: str) -> None:
    """Refuse prompt_logprobs for a prompt whose logits would pass PROMPT_LOGITS_BYTES."""
    if sampling.prompt_logprobs is None or vocab is None:
        return
    if prompt_tokens * vocab * 4 > PROMPT_LOGITS_BYTES:
        most = PROMPT_LOGITS_BYTES // (vocab * 4)
        raise PoolError(ErrorCode.BAD_REQUEST, f"prompt_logprobs: model {key!r} gives them "
                        f"for prompts of up to {most} tokens; this one has {prompt_tokens}")


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int,
                    tokenizer: Any) -> list[TokenLogprob]:
    """Each prompt token's entry, from the prompt pass's logits (one row a position: row
    i predicts token i + 1); the first has none."""
    first = TokenLogprob(_text(tokenizer, ids[0]), ids[0], None)
    return [first, *(token_logprob(logits[i].float(), ids[i + 1], top, tokenizer)
                     for i in range(len(ids) - 1))]


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
