"""Penalties on the tokens a sequence has seen: the repetition penalty (vLLM's and
transformers') on its prompt and output, then OpenAI's frequency and presence penalties on
its output, in vLLM's order, taken off the raw logits before temperature and the cuts. A
sequence that asks for none has no Penalties and pays nothing."""

from __future__ import annotations

import torch

from modelpool.protocol.messages import Sampling


class Penalties:
    """One sequence's penalties and what they need of its tokens: how often each was
    output, and which appeared at all (prompt included)."""

    def __init__(self, prompt_ids: torch.Tensor, presence: float, frequency: float,
                 repetition: float) -> None:
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.prompt_ids = prompt_ids.flatten().cpu()
        # Made at the first step, once the logits tell the vocabulary's size.
        self.counts = torch.zeros(0)  # output tokens, by id
        self.seen = torch.zeros(0, dtype=torch.bool)  # in the prompt or the output

    @classmethod
    def of(cls, sampling: Sampling, prompt_ids: torch.Tensor) -> Penalties | None:
        """The sequence's penalties, or None when it asks for none."""
        presence = sampling.presence_penalty or 0.0
        frequency = sampling.frequency_penalty or 0.0
        repetition = sampling.repetition_penalty or 1.0
        if presence == 0.0 and frequency == 0.0 and repetition == 1.0:
            return None
        return cls(prompt_ids, presence, frequency, repetition)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The sequence's next-token logits (one row, float32) with its penalties taken
        off, as a new tensor."""
        if not self.seen.numel():
            vocab = logits.numel()
            self.counts = torch.zeros(vocab)
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            ids = self.prompt_ids
            self.seen[ids[(ids >= 0) & (ids < vocab)]] = True
        if self.repetition != 1.0:
            logits = torch.where(self.seen, torch.where(logits > 0, logits / self.repetition,
                                                        logits * self.repetition), logits)
        if self.frequency:
            logits = logits - self.frequency * self.counts
        if self.presence:
            logits = logits - self.presence * (self.counts > 0)
        return logits

    def add(self, token: int) -> None:
        """The sequence output this token."""
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1
            self.seen[token] = True
