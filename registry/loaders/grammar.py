"""Structured output: a sequence held to a language (a JSON Schema, a regular expression,
a choice of strings, a Lark grammar) by llguidance, which says before each step which
tokens may come next. Its end is where the language allows end-of-sequence; the mask
leaves the model nothing else once the language is complete.

llguidance bounds what one grammar may cost (its parser limits: the lexer's states, the
work of one step's mask), so a hostile grammar is refused or cut short, not run without
end.

llguidance is imported when a request first asks for structure: ~50 ms that a worker
which never does would pay at its start."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np
import torch

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.fields import Structured

# JSON as json.dumps writes it: no free whitespace, which a model can otherwise emit
# without end. A schema's own "x-guidance" options override these (llguidance's order).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_KEPT = 32  # grammars kept compiled per model, the least recently asked dropped


def grammar_text(structured: Structured) -> str:
    """The llguidance grammar of what the request asks (the kinds table checked that it
    asks exactly one thing)."""
    from llguidance import LLMatcher, grammar_from

    if structured.regex is not None:
        return LLMatcher.grammar_from_regex(structured.regex)
    if structured.choice is not None:
        choices = " | ".join(msgspec.json.encode(c).decode() for c in structured.choice)
        return LLMatcher.grammar_from_lark(f"start: {choices}")
    try:
        if structured.json_schema is not None:
            return LLMatcher.grammar_from_json_schema(structured.json_schema,
                                                      defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        assert structured.grammar is not None
        return grammar_from("grammar", structured.grammar)  # Lark, or GBNF made Lark
    except ValueError as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, f"structured output: {exc}") from None


class Grammars:
    """One model's side of structured output: its vocabulary as llguidance reads it (made
    at the first request that asks, and kept: up to ~1 s for a large vocabulary), and the
    grammars last asked for, compiled: an application sends the same schema again and
    again, and compiling it (1-3 ms) stalls the worker's other sequences."""

    def __init__(self, tokenizer: Any, vocab: int | None, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos_ids = eos_ids
        self._llg_tokenizer: Any = None
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()  # fresh matchers, LRU

    def matcher(self, structured: Structured | None) -> GrammarMatcher | None:
        """A new sequence's matcher, None when it asks for no structure; raises PoolError
        for a grammar that is not one."""
        if structured is None:
            return None
        key = msgspec.json.encode(structured)
        fresh = self._compiled.get(key)
        if fresh is None:
            fresh = self.compile(structured)
            self._compiled[key] = fresh
            if len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarMatcher(fresh.deep_copy())  # its own place in the language

    def compile(self, structured: Structured) -> Any:
        """The grammar compiled against the vocabulary (an llguidance LLMatcher), not
        kept; raises PoolError for a grammar that is not one."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.vocabulary(), grammar_text(structured), log_level=0)
        if matcher.is_error():  # llguidance's way of saying the grammar is not one
            raise PoolError(ErrorCode.BAD_REQUEST,
                            f"structured output: {matcher.get_error().strip()}")
        return matcher

    def vocabulary(self) -> Any:
        """The model's vocabulary as llguidance reads it, read at the first call."""
        if self._llg_tokenizer is None:
            from llguidance import LLTokenizer

            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:  # a slow (Python) tokenizer: llguidance reads fast ones
                raise PoolError(ErrorCode.BAD_REQUEST, "structured output: this model's "
                                "tokenizer cannot be read for it (not a fast one)")
            self._llg_tokenizer = LLTokenizer(
                _without_text_tokens(backend.to_str()), n_vocab=self.vocab,
                eos_token=sorted(self.eos_ids))
        return self._llg_tokenizer


def _without_text_tokens(tokenizer_json: str) -> str:
    """The tokenizer without its added tokens that are text, not special (Qwen3's
    `<think>`): llguidance takes every added token for a special one, which a grammar
    cannot write, yet allows one where its text is forced and then refuses it. Without
    them such text is written in ordinary tokens (as llguidance.hf.from_tokenizer reads
    it otherwise: no padding or truncation)."""
    data = json.loads(tokenizer_json)
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t.get("special")]
    data["padding"] = data["truncation"] = None
    return json.dumps(data)


class GrammarMatcher:
    """One sequence's place in its language."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits (one row) with every token the language does not allow next at
        -inf, as a new tensor."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.numel()]
        if allowed.size < logits.numel():  # the model's rows past the tokenizer's vocabulary
            allowed = np.pad(allowed, (0, logits.numel() - allowed.size))
        return logits.masked_fill(torch.from_numpy(allowed == 0), float("-inf"))

    @property
    def complete(self) -> bool:
        """Nothing may follow but end-of-sequence."""
        return bool(self.matcher.is_stopped())

    def add(self, token: int) -> None:
        """The sequence output this token (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            raise PoolError(ErrorCode.INTERNAL, "structured output: token "
                            f"{token} left the grammar: {self.matcher.get_error()}")


class AfterThinking(GrammarMatcher):
    """A reasoning model's language held off its thinking, as vLLM holds it: the model
    thinks freely and the language starts with the token after the one that closes the
    thinking. A prompt that did not open the thinking leaves the model to: its first
    token may be the opening tag (when the tag is one token), or the answer's first in
    the language."""

    def __init__(self, grammar: GrammarMatcher, closes: str | tuple[str, ...], tokenizer: Any,
                 inside: bool, open_token: int | None) -> None:
        super().__init__(grammar.matcher)
        self.closes = (closes,) if isinstance(closes, str) else closes  # any of these
        self.tokenizer, self.open_token = tokenizer, open_token
        self.state = "inside" if inside else "start" if open_token is not None else "answer"
        self.thought: list[int] = []  # the thinking's last tokens, to find its closing tag

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.state == "inside":
            return logits
        masked = super().mask(logits)
        if self.state == "start" and self.open_token is not None \
                and self.open_token < logits.numel():
            masked[self.open_token] = logits[self.open_token]
        return masked

    @property
    def complete(self) -> bool:
        return self.state == "answer" and super().complete

    def add(self, token: int) -> None:
        if self.state == "start":
            self.state = "inside" if token == self.open_token else "answer"
        elif self.state == "inside":
            # the tag may be several tokens; each is at least a character of it
            self.thought = [*self.thought, token][-max(map(len, self.closes)):]
            decoded = self.tokenizer.decode(self.thought, skip_special_tokens=False)
            if any(closes in decoded for closes in self.closes):
                self.state = "answer"
            return
        if self.state == "answer":
            super().add(token)
