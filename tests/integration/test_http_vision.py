"""A vision model through the HTTP API and the official `openai` package: a chat's
whole conversation and its images, each in its place, as the socket's describe asks
them (compared by the tokens' log-probabilities), and its tools' calls."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import Daemon
from http_helpers import KEY, data_url, http_daemon, png


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    daemon, base = http_daemon(tmp_path_factory.mktemp("http-vision"), tiny_models_dir)
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def sdk(served: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_vision_through_chat(served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """A chat's images and text reach the vision model as the socket's describe places
    them: each image where it was among its message's parts. Compared by the tokens'
    log-probabilities, which move with any change to the prompt."""
    image, green = png((255, 0, 0)), png((0, 255, 0))

    def asked_over_http(messages: list[Any]) -> tuple[str, list[float], int]:
        reply = sdk.chat.completions.create(model="tiny-vision", max_tokens=6, temperature=0,
                                            logprobs=True, messages=messages)
        content = reply.choices[0].logprobs.content or []  # type: ignore[union-attr]
        assert reply.usage is not None
        return (reply.choices[0].message.content or "", [round(t.logprob, 4) for t in content],
                reply.usage.prompt_tokens)

    def asked_over_socket(*args: Any, **kw: Any) -> tuple[str, list[float], int]:
        with served[0].client() as c:
            chunks = list(c.describe(*args, model="tiny-vision", max_tokens=6,
                                     temperature=0, logprobs=0, **kw))
        return ("".join(ch.text for ch in chunks),
                [round(e.logprob, 4) for ch in chunks for e in ch.logprobs or []],
                chunks[-1].prompt_tokens or 0)

    question: Any = [{"type": "text", "text": "what is it?"},
                     {"type": "image_url", "image_url": {"url": data_url(image)}}]
    one = asked_over_http([{"role": "user", "content": question}])
    assert one == asked_over_socket(image, "what is it?", image_offset=11)
    assert one[1] != asked_over_socket(image, "what is it?")[1]  # the image placed first
    # A conversation about it: the system's instructions and the turns before are read
    chat: list[Any] = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": question},
                       {"role": "assistant", "content": one[0]},
                       {"role": "user", "content": "and then?"}]
    as_text = [{**m, "content": "what is it?"} if i == 1 else m for i, m in enumerate(chat)]
    followed = asked_over_http(chat)
    assert followed == asked_over_socket(image, as_text, image_at=1, image_offset=11)
    assert followed[2] > one[2]
    # A second image, before the chat's last question: both are read, each in its place
    two = [*chat[:3], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(green)}},
        {"type": "text", "text": "and then?"}]}]
    both = asked_over_http(two)
    assert both == asked_over_socket(image, as_text, more_images=[green], image_at=[1, 3],
                                     image_offset=[11, 0])
    assert both[2] > followed[2]  # the second image's tokens
    with pytest.raises(openai.BadRequestError, match="image_url"):
        sdk.chat.completions.create(model="tiny-vision", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}])


def test_a_vision_model_calls_tools(served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """The tools go to the vision model's template (the tiny one shows them as Qwen2-VL
    does) and its calls, in Hermes' <tool_call>, come back as tool calls, whole and
    streamed. The model is held to a call by a regex: what one that chose to call writes."""
    called = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tool: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    question: Any = [{"role": "user", "content": [
        {"type": "text", "text": "the weather where this is?"},
        {"type": "image_url", "image_url": {"url": data_url(png((0, 0, 255)))}}]}]
    asked: Any = {"model": "tiny-vision", "messages": question, "max_tokens": 150,
                  "temperature": 0, "extra_body": {"guided_regex": re.escape(called)}}
    choice = sdk.chat.completions.create(**asked, tools=[tool]).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    parts = [p.choices[0] for p in sdk.chat.completions.create(**asked, tools=[tool],
                                                                stream=True) if p.choices]
    pieces = [c for p in parts for c in p.delta.tool_calls or []]
    assert parts[-1].finish_reason == "tool_calls" and len(pieces) > 2  # as written
    assert json.loads("".join(c.function.arguments or "" for c in pieces)) == {  # type: ignore[union-attr]
        "city": "Paris"}
    shown, plain = (sdk.chat.completions.create(**{**asked, "max_tokens": 1, **more}).usage
                    for more in ({"tools": [tool]}, {}))
    assert shown is not None and plain is not None
    assert shown.prompt_tokens > plain.prompt_tokens + 20  # the tools are in its prompt
