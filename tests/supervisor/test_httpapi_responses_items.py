"""A kept response's input items: kept as sent with an id each, listed in OpenAI's item
shapes (an input image's URL only when asked for), a page at a time."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from modelpool.protocol.errors import PoolError
from modelpool.supervisor.httpapi.responses_in import InputItem
from modelpool.supervisor.httpapi.responses_items import (
    include_images,
    kept_items,
    listed,
    page,
    page_options,
)

IMAGE = "data:image/png;base64,iVBORw0KGgo="


def test_an_input_is_kept_as_sent_with_an_id_for_each_item() -> None:
    (text,) = kept_items("hi")
    assert text == {"type": "message", "role": "user", "content": "hi", "id": text["id"]}
    items = kept_items([
        InputItem(role="user", content="weather?"),
        InputItem(type="function_call", call_id="c1", name="weather", arguments="{}",
                  id="fc_abc_0"),
        InputItem(type="function_call_output", call_id="c1", output="sunny")])
    assert [item["id"][:4] for item in items] == ["msg_", "fc_a", "fco_"]
    assert items[1] == {"type": "function_call", "call_id": "c1", "name": "weather",
                        "arguments": "{}", "id": "fc_abc_0"}  # its own id kept
    assert len({text["id"], *(item["id"] for item in items)}) == 4


def test_items_are_listed_in_openais_shapes_an_image_only_when_asked_for() -> None:
    (user,) = kept_items([msgspec.convert({"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": IMAGE}]}, InputItem)])
    assert listed(user, images=True)["content"] == [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": IMAGE}]
    assert listed(user, images=False)["content"][1] == {"type": "input_image"}
    assert user["content"][1]["image_url"] == IMAGE  # the kept item unchanged
    said = {"type": "message", "role": "assistant", "content": "it is", "id": "msg_1"}
    assert listed(said, images=False) == {
        "type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
        "content": [{"type": "output_text", "text": "it is", "annotations": []}]}
    asked = {"type": "message", "role": "developer", "content": "be brief", "id": "msg_2"}
    assert listed(asked, images=False)["content"] == [{"type": "input_text",
                                                       "text": "be brief"}]
    sent_back = {"type": "message", "role": "assistant", "id": "msg_3",
                 "content": [{"type": "output_text", "text": "it is"}]}
    assert listed(sent_back, images=False)["content"] == [
        {"type": "output_text", "text": "it is", "annotations": []}]
    cut = {"type": "function_call", "id": "fc_1", "status": "incomplete"}
    assert listed(cut, images=False)["status"] == "incomplete"  # an answer's own status


def _ids(listing: dict[str, Any]) -> list[str]:
    return [item["id"] for item in listing["data"]]


def test_a_page_is_the_items_after_the_cursor_in_order() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    first = page(items, None, 2, "desc")
    assert _ids(first) == ["i4", "i3"] and first["has_more"]
    assert (first["object"], first["first_id"], first["last_id"]) == ("list", "i4", "i3")
    last = page(items, "i1", 2, "desc")
    assert _ids(last) == ["i0"] and not last["has_more"]
    assert _ids(page(items, "i2", 2, "asc")) == ["i3", "i4"]
    assert not page(items, "i2", 2, "asc")["has_more"]
    assert page(items, None, 20, "asc")["data"] == items
    empty = page(items, "i4", 20, "asc")
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]
    with pytest.raises(PoolError) as unknown:
        page(items, "nope", 2, "asc")
    assert unknown.value.message.startswith("after: ")


@pytest.mark.parametrize(("query", "field"), [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "two"}, "limit"),
    ({"order": "newest"}, "order")])
def test_a_lists_options_out_of_range_are_refused_by_name(query: dict[str, str],
                                                           field: str) -> None:
    with pytest.raises(PoolError) as refused:
        page_options(query)
    assert refused.value.message.startswith(f"{field}: ")


def test_a_lists_options_default_to_twenty_latest_first() -> None:
    assert page_options({}) == (None, 20, "desc")
    assert page_options({"after": "x", "limit": "100", "order": "asc"}) == ("x", 100, "asc")
    assert include_images(["message.input_image.image_url"]) and not include_images([])
    with pytest.raises(PoolError) as refused:
        include_images(["file_search_call.results"])
    assert refused.value.message.startswith("include: ")
