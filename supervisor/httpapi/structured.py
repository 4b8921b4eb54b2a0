"""Structured output in the HTTP bodies: OpenAI's `response_format`, vLLM's
`structured_outputs` and its earlier `guided_*` fields, each naming the one language
the output keeps to (a JSON Schema, a regular expression, a choice, a grammar)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError

Schema = dict[str, Any] | bool | str  # a JSON Schema, or its JSON text
GuidedChoice = Annotated[list[str], msgspec.Meta(min_length=1)]
ANY_OBJECT = {"type": "object"}


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = ""
    description: str | None = None
    schema: dict[str, Any] | bool | None = None  # None: any JSON object
    strict: bool | None = None  # the output always keeps to the schema here


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's structured outputs: one of these."""

    json: Schema | None = None
    regex: str | None = None
    choice: GuidedChoice | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None


def language(form: ResponseFormat | None, vllm: StructuredOutputs | None,
             guided: tuple[Schema | None, str | None, list[str] | None, str | None]
             ) -> dict[str, Any]:
    """The client's keywords (json_schema, regex, choice, grammar) for the one language a
    body asks for, {} for free text; more than one asking is refused by name."""
    asked: dict[str, dict[str, Any]] = {}
    if form is not None and form.type != "text":
        schema = form.json_schema.schema if form.json_schema else None
        asked["response_format"] = {"json_schema": ANY_OBJECT if schema is None else schema}
    if vllm is not None:
        given = {"json_schema": ANY_OBJECT if vllm.json_object else vllm.json,
                 "regex": vllm.regex, "choice": vllm.choice, "grammar": vllm.grammar}
        asked["structured_outputs"] = {k: v for k, v in given.items() if v is not None}
    for name, value in zip(("json", "regex", "choice", "grammar"), guided, strict=True):
        if value is not None:
            asked["guided_" + name] = {"json_schema" if name == "json" else name: value}
    if len(asked) > 1:
        first, *others = asked
        raise PoolError(ErrorCode.BAD_REQUEST, f"{first}: one language for the output; "
                        f"{' and '.join(others)} also asks for one")
    return next(iter(asked.values()), {})
