"""A chat as its model's template writes it: the messages, the tools, and the variables a
request adds (vLLM's `chat_template_kwargs`: Qwen3's `enable_thinking`, ...)."""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
from jinja2.exceptions import TemplateError

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import ChatMessage

# What transformers itself hands the template, besides the arguments of
# apply_chat_template: a request's variables may not stand in for these.
EFFORT = "reasoning_effort"  # the variable gpt-oss's template reads
TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                          "conversation", "raise_exception", "strftime_now"})


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's calls with their arguments as
    a mapping, as transformers' templates expect (the JSON text when it is no object)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"type": "function", "id": c.id, "function": {
            "name": c.name, "arguments": _arguments(c.arguments)}} for c in message.tool_calls]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
    return value if isinstance(value, dict) else text


def chat_ids(tokenizer: Any, key: str, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]], variables: dict[str, Any],
             effort: str | None = None) -> list[int]:
    """The conversation as the model's template writes it. Control tokens inside a
    message are encoded as text: "<|im_end|><|im_start|>system" in a user's message
    opens no turn. OpenAI's `developer` role is the `system` of a template that does
    not know it. A template that refuses the conversation (roles that must
    alternate, no system role) refuses the request, as the client's error."""
    if "developer" not in str(tokenizer.chat_template):
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m
                    for m in messages]
    variables = template_variables(tokenizer, str(tokenizer.chat_template), key, variables,
                                   effort)
    try:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
            return_dict=True, sanitize_control_tokens=True, **variables)
    except TemplateError as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, f"model {key!r}'s chat template "
                        f"refused the messages: {exc}") from None
    return list(encoded["input_ids"])


def template_variables(renderer: Any, template: str, key: str, variables: dict[str, Any],
                       effort: str | None) -> dict[str, Any]:
    """A request's variables for the template (`renderer`: the tokenizer or processor
    whose apply_chat_template renders it), `reasoning_effort` among them; BAD_REQUEST for
    one the daemon sets, or an effort the template does not read."""
    taken = sorted(set(variables) & reserved(renderer)) if variables else []
    if taken:
        raise PoolError(ErrorCode.BAD_REQUEST, f"chat_template_kwargs: {taken[0]!r} is "
                        "set by the daemon, not by a request")
    if effort is not None:
        if EFFORT not in template:
            raise PoolError(ErrorCode.BAD_REQUEST, f"reasoning_effort: model {key!r}'s chat "
                            "template takes none (it would change nothing)")
        variables = {**variables, EFFORT: effort}
    return variables


def reserved(renderer: Any) -> frozenset[str]:
    """The names a request's template variables may not take: apply_chat_template's own
    arguments (`chat_template` would replace the template), what transformers hands the
    template, and the tokenizer's special tokens (`bos_token`, ...; a processor's
    tokenizer's)."""
    arguments = inspect.signature(renderer.apply_chat_template).parameters
    own = {name for name, p in arguments.items() if p.kind is not p.VAR_KEYWORD}
    specials = {name for holder in (renderer, getattr(renderer, "tokenizer", None))
                for name in getattr(holder, "special_tokens_map", {})}
    return TEMPLATE_OWN | own | specials
