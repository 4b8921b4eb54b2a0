"""What a sequence asks to be done to its logits before sampling, in vLLM's order: OpenAI's
logit_bias, then the repetition penalty (vLLM's and transformers') on the tokens of its
prompt and output, then OpenAI's frequency and presence penalties on its output; all
on the raw logits, before temperature and the cuts. Until it has min_tokens, the tokens
that would end it are left out (unless its grammar is complete). Last, its grammar's
mask (structured output, grammar.py). A sequence that asks for none of these has no
LogitRules and pays nothing."""

from __future__ import annotations

import torch

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Sampling
from modelpool.registry.loaders.grammar import GrammarMatcher


class LogitRules:
    """One sequence's biases, penalties and ending tokens held off, and what they need of
    its tokens: how often each was output, which appeared at all (prompt included), how
    many were output."""

    def __init__(self, prompt_ids: torch.Tensor, presence: float, frequency: float,
                 repetition: float, bias: dict[int, float] | None = None,
                 ends: set[int] | None = None, min_tokens: int = 0,
                 grammar: GrammarMatcher | None = None) -> None:
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.bias = bias or {}
        self.ends = sorted(ends or ())  # left out until min_tokens are output
        self.min_tokens, self.output = min_tokens, 0
        self.grammar = grammar
        self.prompt_ids = prompt_ids.flatten().cpu()
        # Made at the first step, once the logits tell the vocabulary's size; the counts
        # only for the penalties, which alone read them.
        self.vocab = 0
        self.counts = torch.zeros(0)  # output tokens, by id
        self.seen = torch.zeros(0, dtype=torch.bool)  # in the prompt or the output
        self.biases = torch.zeros(0)  # by id
        self.ending = torch.zeros(0, dtype=torch.long)  # ends' ids within the vocabulary

    @classmethod
    def of(cls, sampling: Sampling, prompt_ids: torch.Tensor,
           eos_ids: set[int], grammar: GrammarMatcher | None = None) -> LogitRules | None:
        """The sequence's rules, or None when it asks for none."""
        presence = sampling.presence_penalty or 0.0
        frequency = sampling.frequency_penalty or 0.0
        repetition = sampling.repetition_penalty or 1.0
        ends = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else eos_ids)
        min_tokens = sampling.min_tokens if ends else 0
        if (presence == 0.0 and frequency == 0.0 and repetition == 1.0
                and not sampling.logit_bias and not min_tokens and grammar is None):
            return None
        return cls(prompt_ids, presence, frequency, repetition, sampling.logit_bias, ends,
                   min_tokens, grammar)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The sequence's next-token logits (one row, float32) with its biases added, its
        penalties taken off and its ending tokens held off, as a new tensor."""
        if not self.vocab:
            self._start(logits.numel())
        if self.bias:
            logits = logits + self.biases
        if self.repetition != 1.0:
            logits = torch.where(self.seen, torch.where(logits > 0, logits / self.repetition,
                                                        logits * self.repetition), logits)
        if self.frequency:
            logits = logits - self.frequency * self.counts
        if self.presence:
            logits = logits - self.presence * (self.counts > 0)
        if self.output < self.min_tokens and not (self.grammar and self.grammar.complete):
            logits = logits.index_fill(0, self.ending, float("-inf"))
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        return logits

    def _start(self, vocab: int) -> None:
        self.vocab = vocab
        if self.presence or self.frequency or self.repetition != 1.0:
            self.counts = torch.zeros(vocab)
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            ids = self.prompt_ids
            self.seen[ids[(ids >= 0) & (ids < vocab)]] = True
        self.biases = torch.zeros(vocab)
        for token, bias in self.bias.items():
            if token < vocab:  # check_logit_bias refused the others when it was prepared
                self.biases[token] = bias
        self.ending = torch.tensor([t for t in self.ends if t < vocab], dtype=torch.long)

    def add(self, token: int) -> None:
        """The sequence output this token."""
        self.output += 1
        if self.grammar is not None:
            self.grammar.add(token)
        if 0 <= token < self.counts.numel():
            self.counts[token] += 1
            self.seen[token] = True


def check_logit_bias(sampling: Sampling, vocab: int | None, key: str) -> None:
    """Refuse a logit_bias naming a token the model does not have (as vLLM does)."""
    outside = [t for t in sampling.logit_bias or {} if vocab is not None and t >= vocab]
    if outside:
        raise PoolError(ErrorCode.BAD_REQUEST, f"logit_bias names token {outside[0]}; "
                        f"model {key!r} has {vocab} tokens")
