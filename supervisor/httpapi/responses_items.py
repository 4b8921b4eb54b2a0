"""A kept response's input items: kept as they were sent (each with an id), continued by
`previous_response_id` and listed by GET /v1/responses/{id}/input_items (the SDK's
`responses.input_items.list`), in OpenAI's item shapes, a page at a time.

A continued response's items are the whole conversation that led to it, as OpenAI lists
them: the items of the response it continues, that response's output items, then its own
input.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from modelpool.supervisor.httpapi.bodies import bad
from modelpool.supervisor.httpapi.responses_in import InputItem

IMAGES_INCLUDE = "message.input_image.image_url"
MAX_PAGE = 100
# A new input item's id: by its type (an answer's own items are msg_ and fc_ too)
ITEM_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
                  "reasoning": "rs_"}


def kept_items(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """An input's items as kept: as sent, without their empty fields, each with its own
    id or a new one."""
    if isinstance(items, str):
        items = [InputItem(role="user", content=items)]
    return [{**_without_nones(msgspec.to_builtins(item)),
             "id": item.id or f"{ITEM_ID_PREFIX.get(item.type, 'item_')}{uuid.uuid4().hex}"}
            for item in items]


def _without_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value


def listed(item: dict[str, Any], images: bool) -> dict[str, Any]:
    """A kept item in OpenAI's shape: a message's content as parts (an assistant's as
    output text), a status; an input image's URL only if asked for (`images`)."""
    out = {"status": "completed", **item}
    if item.get("type") == "message":
        content = item.get("content", [])
        if isinstance(content, str):
            content = ([{"type": "output_text", "text": content, "annotations": []}]
                       if item.get("role") == "assistant"
                       else [{"type": "input_text", "text": content}])
        out["content"] = [_listed_part(part, images) for part in content]
    return out


def _listed_part(part: dict[str, Any], images: bool) -> dict[str, Any]:
    if part.get("type") == "input_image" and not images:
        return {k: v for k, v in part.items() if k != "image_url"}
    if part.get("type") == "output_text":  # an answer's text sent back as input
        return {"annotations": [], **part}
    return part


def include_images(include: list[str]) -> bool:
    for name in include:
        if name != IMAGES_INCLUDE:
            raise bad("include", f"{name!r} is not supported; only {IMAGES_INCLUDE!r}")
    return IMAGES_INCLUDE in include


def page(items: list[dict[str, Any]], after: str | None, limit: int,
         order: Literal["asc", "desc"]) -> dict[str, Any]:
    """One page of a list of items (OpenAI's cursor list): `limit` items in `order` (desc:
    the latest first), from the one after the item whose id is `after`."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((index + 1 for index, item in enumerate(ordered)
                      if item.get("id") == after), 0)
        if not start:
            raise bad("after", "no item of this response has this id")
    data = ordered[start:start + limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}


def page_options(query: Mapping[str, str]) -> tuple[str | None, int, Literal["asc", "desc"]]:
    """`after`, `limit` (1 to 100, 20 by default) and `order` (desc by default) of a
    list's query."""
    raw = query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        raise bad("limit", "an integer from 1 to 100") from None
    if not 1 <= limit <= MAX_PAGE:
        raise bad("limit", f"from 1 to {MAX_PAGE}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("order", "asc or desc")
    return query.get("after"), limit, order
