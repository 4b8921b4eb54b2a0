"""The completions API's prompts without a server: one or several in a body, texts or
token ids, and the choices they make (OpenAI's order: each prompt's n in turn)."""

from __future__ import annotations

import msgspec
import pytest

from modelpool.protocol.errors import PoolError
from modelpool.supervisor.httpapi import bodies, completions


def _body(**fields: object) -> bodies.CompletionBody:
    return msgspec.convert(fields, type=bodies.CompletionBody)  # as JSON gives them


def test_a_body_takes_one_prompt_or_a_list_of_texts_or_of_token_ids() -> None:
    def asked(prompt: object) -> list[object]:
        return [call.args[0] for call in completions.completion_calls(_body(prompt=prompt))]

    assert asked("a") == ["a"] and asked([5, 6]) == [[5, 6]] and asked([[5, 6]]) == [[5, 6]]
    assert asked(["a", "b"]) == ["a", "b"] and asked([[5], [6, 7]]) == [[5], [6, 7]]
    assert asked(["a", [5]]) == ["a", [5]]  # texts and token ids, each a prompt
    calls = completions.completion_calls(_body(prompt=["a", "b"], max_tokens=3, seed=1))
    assert calls[0].kwargs == calls[1].kwargs and calls[0].kwargs["max_tokens"] == 3


def test_token_ids_mixed_with_prompts_and_too_many_choices_are_refused() -> None:
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: prompt: .*mixed"):
        completions.completion_calls(_body(prompt=["a", 5]))
    limit = completions.MAX_PROMPT_CHOICES
    assert len(completions.completion_calls(_body(prompt=["p"] * (limit // 4), n=4))) == limit // 4
    with pytest.raises(PoolError, match=rf"^BAD_REQUEST: prompt: .* at most {limit} choices"):
        completions.completion_calls(_body(prompt=["p"] * (limit // 4 + 1), n=4))


def test_echoed_prompts_are_each_prompt_and_a_job_takes_one() -> None:
    assert completions.echoed(_body(prompt=["a", "b"], echo=True)) == ["a", "b"]
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: echo: .* logprobs"):
        completions.completion_calls(_body(prompt=["a", [5]], echo=True))
    assert completions.completion_call(_body(prompt=["a"])).args == ("a",)
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: prompt: one prompt a job"):
        completions.completion_call(_body(prompt=["a", "b"]))
