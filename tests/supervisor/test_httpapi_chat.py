"""A chat body as the pool's call, without a server: a chat with images goes to a vision
model whole, each image in its place; an image is never a local file."""

from __future__ import annotations

import base64

import msgspec
import pytest
from test_httpapi import body

from modelpool.protocol.errors import PoolError
from modelpool.protocol.messages import ImageInput
from modelpool.supervisor.httpapi import bodies
from modelpool.supervisor.httpapi.chat import chat_call


def test_chat_with_an_image_asks_a_vision_model_about_it() -> None:
    image = base64.b64encode(b"\x89PNG...").decode()
    asked = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]},
        {"role": "assistant", "content": "a cat"}, {"role": "user", "content": "its colour?"}]
    call = chat_call(body(bodies.ChatBody, model="v", max_completion_tokens=5,
                                 stop="END", messages=asked))
    assert call.op == "describe" and call.args == (ImageInput(data=b"\x89PNG..."), [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "what is it?"},
        {"role": "assistant", "content": "a cat"}, {"role": "user", "content": "its colour?"}])
    assert call.kwargs["image_at"] == [1]  # the whole chat, the image in its own message
    second = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
    two = chat_call(body(bodies.ChatBody, messages=[*asked[:3], {
        "role": "user", "content": [second, {"type": "text", "text": "and this?"}]}]))
    assert len(two.kwargs["more_images"]) == 1 and two.kwargs["image_at"] == [1, 3]
    assert two.kwargs["image_offset"] == [11, 0]  # after "what is it?"; before "and this?"
    with pytest.raises(PoolError, match="at most 16 images"):
        chat_call(body(bodies.ChatBody, messages=[
            {"role": "user", "content": [second] * 17}]))
    assert call.kwargs["max_tokens"] == 5 and call.kwargs["stop"] == ["END"]
    with pytest.raises(PoolError, match="a user's message"):
        chat_call(body(bodies.ChatBody, messages=[{"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}]))
    text = chat_call(body(bodies.ChatBody, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    assert text.op == "generate" and text.args[0][1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("url", ["/etc/passwd", "file:///etc/passwd", "data:image/png,raw"])
def test_an_image_is_never_a_local_file(url: str) -> None:
    with pytest.raises((PoolError, msgspec.ValidationError)):
        chat_call(body(bodies.ChatBody, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]))
