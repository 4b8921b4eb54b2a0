"""tokenize and detokenize on a text_to_text model: a generate request's prompt as the
model reads it (the same chat template, tools and variables), and token ids back into
text. Neither runs the model: each is answered as soon as its worker reads it."""

from __future__ import annotations

from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import (
    Detokenize,
    Detokenized,
    Generate,
    Tokenize,
    Tokenized,
)
from modelpool.workers.capabilities import text_limits

REQUESTS = (Tokenize, Detokenize)


def answer(model: Any, job_id: int, request: Tokenize | Detokenize) -> Tokenized | Detokenized:
    """Raises PoolError for ids the model does not have, a prompt too long to read, or a
    model whose loader gives no tokenizer."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or not hasattr(model, "prompt_ids"):
        raise PoolError(ErrorCode.BAD_REQUEST, "this model's loader gives no tokenizer: it "
                        f"cannot {type(request).__name__.lower()}")
    if isinstance(request, Detokenize):
        vocab = getattr(model, "vocab", None)
        outside = [t for t in request.tokens if vocab and t >= vocab]
        if outside:
            raise PoolError(ErrorCode.BAD_REQUEST, f"tokens: token {outside[0]} is not one of "
                            f"the model's {vocab}")
        return Detokenized(id=job_id, prompt=tokenizer.decode(request.tokens))
    text_limits.check_chat(model, request.prompt, request.messages)
    ids = model.prompt_ids(Generate(
        id=job_id, prompt=request.prompt, messages=request.messages, raw=request.raw,
        tools=request.tools, chat_template_kwargs=request.chat_template_kwargs,
        reasoning_effort=request.reasoning_effort))
    strs = tokenizer.convert_ids_to_tokens(ids) if request.token_strs else None
    return Tokenized(id=job_id, tokens=ids, token_strs=strs,
                     max_model_len=int(model.info().get("context") or 0))
