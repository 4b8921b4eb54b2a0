"""Bounding text by characters before a tokenizer sees it.

A tokenizer's time and memory grow with the characters it is given, not with the tokens
the model keeps: an 8 MB text took 1.7 GB and 9 s to embed 256 tokens. No token in the
vocabularies we serve stands for more than MAX_CHARS_PER_TOKEN characters of ordinary
text, so the first `tokens * MAX_CHARS_PER_TOKEN` characters hold every token a model
can see: embedding and scoring inputs are cut there (the model would truncate them
anyway), and a prompt longer than that cannot fit the context at all and is refused.
"""

from __future__ import annotations

from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import ChatMessage
from modelpool.protocol.pipes import token_limit

MAX_CHARS_PER_TOKEN = 64  # whitespace runs and [UNK] words aside, tokens are far shorter


def char_limit(model: Any) -> int | None:
    info = model.info() if hasattr(model, "info") else {}
    tokens = token_limit(info if isinstance(info, dict) else {})
    return None if tokens is None else tokens * MAX_CHARS_PER_TOKEN


def clip(texts: list[str], limit: int | None) -> list[str]:
    """Each text cut to limit characters (what the model can see of it, and more)."""
    if limit is None:
        return texts
    return [text[:limit] if len(text) > limit else text for text in texts]


def check_chat(model: Any, prompt: str, messages: list[ChatMessage]) -> None:
    """Refuse a generate (or tokenize) request's prompt that cannot fit the model's
    context: its text, its messages' and the arguments of their tool calls."""
    chars = len(prompt) + sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                              for m in messages)
    check_prompt(chars, char_limit(model))


def check_prompt(chars: int, limit: int | None) -> None:
    """Refuse a prompt that cannot fit the model's context, before tokenizing it."""
    if limit is not None and chars > limit:
        raise PoolError(ErrorCode.BAD_REQUEST,
                        f"prompt of {chars} characters cannot fit the model's context "
                        f"({limit // MAX_CHARS_PER_TOKEN} tokens; at most {limit} characters "
                        "are read)")
