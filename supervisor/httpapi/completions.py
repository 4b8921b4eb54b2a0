"""The completions API's prompts: one, or several in one body (OpenAI's list of prompts,
which evaluation harnesses send a batch at a time), each a text or token ids, and what
each asks of the pool. A body's choices are its prompts' in order, `n` for each: choice
i is prompt i // n's."""

from __future__ import annotations

from modelpool.supervisor.httpapi.bodies import (
    CompletionBody,
    PoolCall,
    bad,
    sampling_kwargs,
)

# Choices in one body, its prompts times n: as many streams as that many requests.
MAX_PROMPT_CHOICES = 64
Prompt = str | list[int]


def prompts(body: CompletionBody) -> list[Prompt]:
    """Its prompts: texts or token ids, in order."""
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(token, int) for token in prompt):
        return [prompt]  # type: ignore[list-item]
    if any(isinstance(token, int) for token in prompt):
        raise bad("prompt", "a prompt (text or token ids) or a list of prompts, not token "
                            "ids and prompts mixed")
    if len(prompt) * body.n > MAX_PROMPT_CHOICES:
        raise bad("prompt", f"{len(prompt)} prompts, {body.n} choices each: at most "
                            f"{MAX_PROMPT_CHOICES} choices in one body")
    return list(prompt)  # type: ignore[arg-type]


def echoed(body: CompletionBody) -> list[Prompt] | None:
    """The prompts a completion asks to have before their texts (echo), else None."""
    return prompts(body) if body.echo else None


def completion_calls(body: CompletionBody) -> list[PoolCall]:
    """One generation per prompt (each run `n` times)."""
    asked = prompts(body)
    if isinstance(body.logprobs, bool):
        raise bad("logprobs", "the number of likeliest alternatives in a completion, "
                              "from 0 to 20")
    if body.echo and body.stream and body.logprobs is not None:
        raise bad("echo", "streamed without logprobs only: the prompt's come at the end "
                          "of its stream; ask for them without stream")
    if body.echo and body.logprobs is None and not all(isinstance(p, str) for p in asked):
        raise bad("echo", "a prompt of token ids is echoed as its tokens' text, which comes "
                          "with logprobs: ask for them")
    prompt_logprobs = body.logprobs if body.echo else None  # echoed with the prompt
    kwargs = {**sampling_kwargs(body, None, body.logprobs), "prompt_logprobs": prompt_logprobs,
              "raw": True, "cache_salt": body.cache_salt}
    return [PoolCall("generate", (prompt,), kwargs) for prompt in asked]


def completion_call(body: CompletionBody) -> PoolCall:
    """The one generation of a body that has one prompt (a job's)."""
    calls = completion_calls(body)
    if len(calls) > 1:
        raise bad("prompt", "one prompt a job: submit several jobs")
    return calls[0]
