"""Requests of hostile values, each of its field's type: built from the request's own JSON
schema (msgspec's), each value drawn from the edges of what its type and bounds allow
(0, -1, 2**63 - 1, 1e300, empty and 3,000-character strings, special tokens, template
syntax, unreadable images), then most of them made coherent enough (one kind of prompt, a
user's message for the image, its tools for tool_choice) to get past validation and reach
the model with the rest of their values as drawn."""

from __future__ import annotations

import io
import random
from typing import Any

import msgspec
from PIL import Image

STRINGS = ["", "\x00", "a" * 3000, "<tool_call>", "{{ raise_exception('x') }}", "é😀\ufffd",
           "<|im_start|>", "user", "assistant", "tool", "get_weather", "[", "<think>",
           "\n" * 50, '{"type": "object"}', "(a|b)*c", 'start: "x"', "x" * 300]
INTS = [0, 1, -1, 2, 7, 31, 255, 10**6, 2**31 - 1, 2**31, 2**53, 2**63 - 1, -2**63]
FLOATS = [0.0, 1e-300, 0.5, 1.0, 2.0, 99.9, 100.0, -0.0, 1e300, -1e300]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SHORT = ["hi", "", "a" * 40, "<tool_call>", "é😀", "<|im_start|>", "\n\n", "what is this?",
         "{{ x }}", "<think>"]


def png(side: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), (200, 10, 10)).save(out, "PNG")
    return out.getvalue()


class HostileValues:
    """Values for a msgspec Struct's JSON schema; ImageInput's are images."""

    def __init__(self, struct: type[msgspec.Struct], rng: random.Random) -> None:
        schema = msgspec.json.schema(struct)
        self.defs = schema["$defs"]
        self.top = self.defs[struct.__name__]
        self.rng = rng
        self.images = [png(side) for side in (1, 8, 64)]

    def request(self) -> dict[str, Any]:
        return self.value(self.top)  # type: ignore[no-any-return]

    def value(self, schema: dict[str, Any], depth: int = 0) -> Any:
        rng = self.rng
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            if name == "ImageInput":
                return {"data": rng.choice([*self.images * 3, b"", b"\x89PNG", bytes(20)])}
            return self.value(self.defs[name], depth + 1)
        if "anyOf" in schema:
            return self.value(rng.choice(schema["anyOf"]), depth)
        if "enum" in schema:
            return rng.choice(schema["enum"])
        return self._typed(schema, schema.get("type"), depth)

    def _typed(self, schema: dict[str, Any], kind: str | None, depth: int) -> Any:
        rng = self.rng
        if kind == "object":
            if "properties" in schema:
                required = set(schema.get("required", []))
                return {k: self.value(v, depth + 1) for k, v in schema["properties"].items()
                        if k in required or (depth < 4 and rng.random() < 0.35)}
            keys = schema.get("propertyNames", {"type": "string"})
            return {self.value(keys, depth + 1): self.value(
                schema.get("additionalProperties", {}), depth + 1)
                for _ in range(rng.randint(0, 3) if depth < 4 else 0)}
        if kind == "array":
            low = schema.get("minItems", 0)
            high = max(low, min(schema.get("maxItems", 4), 4 if depth < 4 else 0))
            return [self.value(schema.get("items", {}), depth + 1)
                    for _ in range(rng.randint(low, high))]
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength", 10**9)
            return (rng.choice(STRINGS) + "x" * low)[:high]
        if kind == "integer":
            low, high = schema.get("minimum", -2**63), schema.get("maximum", 2**63 - 1)
            return rng.choice([v for v in INTS if low <= v <= high] + [low, high])
        if kind == "number":
            low, high = schema.get("minimum", -1e308), schema.get("maximum", 1e308)
            above = schema.get("exclusiveMinimum", -1e308)
            return rng.choice([v for v in FLOATS if low <= v <= high and v > above] + [high])
        if kind == "boolean":
            return rng.random() < 0.5
        return None


def _chat(rng: random.Random) -> list[dict[str, str]]:
    roles = ["system"] if rng.random() < 0.3 else []
    roles += ["user" if i % 2 == 0 else "assistant" for i in range(rng.choice([1, 3, 5]))]
    if rng.random() < 0.2:
        roles.append(rng.choice(["tool", "assistant", "user", "moderator"]))
    return [{"role": role, "content": rng.choice(SHORT)} for role in roles]


def coherent(op: str, body: dict[str, Any], rng: random.Random, images: list[bytes]) -> None:
    """One kind of prompt, tools for tool_choice, one structured language, the tiny
    model's token ids: what validation refuses first, so that the rest reaches the
    model."""
    body.pop("reasoning_effort", None)  # the tiny templates read none
    if op == "detokenize":
        body["tokens"] = [rng.randrange(1024) for _ in range(rng.randint(0, 20))]
        return
    if body.get("tool_choice") == "auto" or rng.random() < 0.3:
        body["tools"] = [TOOL]
    sampling = body.setdefault("sampling", {}) if op in ("generate", "describe") else {}
    if isinstance(sampling.get("structured"), dict) and sampling["structured"]:
        language, value = rng.choice(list(sampling["structured"].items()))
        sampling["structured"] = {language: value or "x"}
    for key in ("logit_bias", "stop_token_ids"):
        if sampling.get(key):
            sampling[key] = {rng.randrange(1024): v for v in sampling[key].values()} \
                if key == "logit_bias" else [rng.randrange(1024) for _ in sampling[key]]
    if op == "describe":
        _describe(body, rng, images)
    else:
        _generate(body, rng, prompt_ids=op == "generate")


def _generate(body: dict[str, Any], rng: random.Random, prompt_ids: bool) -> None:
    for key in ("prompt", "messages", "prompt_ids"):
        body.pop(key, None)
    shape = rng.choice(["prompt", "messages", "prompt_ids"][:3 if prompt_ids else 2])
    if shape == "prompt":
        body["prompt"] = rng.choice(SHORT) or "x"
    elif shape == "messages":
        body["messages"], body["raw"] = _chat(rng), False
    else:
        body["prompt_ids"] = [rng.randrange(1024) for _ in range(rng.randint(1, 20))]
        for key in ("tools", "tool_choice", "chat_template_kwargs"):
            body.pop(key, None)


def _describe(body: dict[str, Any], rng: random.Random, images: list[bytes]) -> None:
    for key in ("prompt", "messages", "more_images", "more_at", "more_offsets"):
        body.pop(key, None)
    if rng.random() < 0.4:
        body["prompt"] = rng.choice(SHORT)
        body["image_at"], body["image_offset"] = 0, rng.randint(0, len(body["prompt"]))
        return
    chat = body["messages"] = _chat(rng)
    users = [i for i, m in enumerate(chat) if m["role"] == "user"]
    body["image_at"] = rng.choice(users)
    body["image_offset"] = rng.randint(0, len(chat[body["image_at"]]["content"]))
    if count := rng.randint(0, 3):
        body["more_images"] = [{"data": rng.choice(images)} for _ in range(count)]
        body["more_at"] = sorted(rng.choice(users) for _ in range(count))
        body["more_offsets"] = [rng.randint(0, len(chat[at]["content"]))
                                for at in body["more_at"]]
