"""Tokens' log-probabilities in OpenAI's two shapes: chat's list of output tokens, each
with its likeliest alternatives, and the completions API's parallel lists (the chosen
token among its alternatives, as vLLM reports it, and each token's offset in the text;
with `echo`, the prompt's tokens first, the first of them with none)."""

from __future__ import annotations

from typing import Any

from modelpool.protocol.messages import TokenLogprob


def chat(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{**_token(e.token, e.logprob),
                         "top_logprobs": [_token(t.token, t.logprob) for t in e.top]}
                        for e in entries], "refusal": None}


def _token(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def completion(entries: list[TokenLogprob] | None, offset: int = 0
               ) -> tuple[dict[str, Any] | None, int]:
    """The entries as the completions API lists them, their text offsets counted from
    `offset` (the text before them); and the offset after them."""
    if entries is None:
        return None, offset
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else
                             {t.token: t.logprob for t in e.top} | {e.token: e.logprob}
                             for e in entries],
            "text_offset": offsets}, offset
