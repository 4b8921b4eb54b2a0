"""A reasoning model's thinking, apart from its answer, through the official `openai`
package: chat's `reasoning_content` (vLLM's and DeepSeek's field), whole and streamed,
and the Responses API's reasoning item and `response.reasoning_text` events; the
socket client's chunks carry the same. tiny-thinker plays a reasoning model: its chat
template opens the thinking (as DeepSeek-R1-0528's does). As MODEL it is held by a regex
to a thought and an answer where the test needs both (its language holds the thinking
too: `structured_in_reasoning`); as FIRST it thinks freely before a structured answer,
its thinking closed by a bias on its `</think>` token."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
from conftest import ROOT, Daemon
from http_helpers import KEY, data_url, http_daemon, png
from test_http_responses import _ended
from test_http_service import _samples

MODEL = "tiny-thinker"
FIRST = "thinks-first"  # the language holds only its answer, as vLLM holds it
WRITTEN = "<think>\nThe user wants a city.\n</think>\n\nParis."
HELD = {"extra_body": {"guided_regex": re.escape(WRITTEN)}}
QUESTION = [{"role": "user", "content": "tell me about workers"}]
# Seeded: greedy, the tiny model says only newlines after this prompt
SAMPLED: Any = {"temperature": 1.0, "seed": 3}
SAMPLED_RESPONSE: Any = {"temperature": 1.0, "extra_body": {"seed": 3}}  # vLLM's extension


def _vision_thinker(tiny_models_dir: Path, workdir: Path) -> Path:
    """tiny-vision whose template's generation prompt opens the thinking."""
    model_dir = workdir / "vision-thinker"
    shutil.copytree(tiny_models_dir / "tiny-vision", model_dir)
    template = model_dir / "chat_template.jinja"
    prompt = "'<|im_start|>assistant\\n'"
    assert template.read_text().count(prompt) == 1
    template.write_text(template.read_text().replace(prompt, prompt[:-1] + "<think>\\n'"))
    return model_dir


def _harmony(tiny_models_dir: Path, workdir: Path) -> Path:
    """tiny-llm whose template writes harmony's channels, as gpt-oss's does."""
    model_dir = workdir / "tiny-harmony"
    shutil.copytree(tiny_models_dir / "tiny-llm", model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] += ("{#- its answers: <|channel|>final<|message|>... -#}"
                                "{% if reasoning_effort is defined %}Reasoning: "
                                "{{ reasoning_effort }}{% endif %}")
    config_path.write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    workdir = tmp_path_factory.mktemp("http-reasoning")
    daemon, base = http_daemon(workdir, tiny_models_dir, extra=f"""
        [[models]]
        key = "{MODEL}"
        capability = "text_to_text"
        path = "{tiny_models_dir / 'tiny-thinker'}"
        options = {{ context = 1024, structured_in_reasoning = true }}
        [[models]]
        key = "{FIRST}"
        capability = "text_to_text"
        path = "{tiny_models_dir / 'tiny-thinker'}"
        options = {{ context = 1024 }}
        [[models]]
        key = "tiny-harmony"
        capability = "text_to_text"
        path = "{_harmony(tiny_models_dir, workdir)}"
        options = {{ context = 1024, structured_in_reasoning = true }}
        [[models]]
        key = "vision-thinker"
        capability = "vision"
        path = "{_vision_thinker(tiny_models_dir, workdir)}"
        options = {{ reasoning_format = "think" }}
        [[models]]
        key = "vision-thinker-alone"
        capability = "vision"
        path = "{workdir / 'vision-thinker'}"
        max_active_sequences = 1
        options = {{ reasoning_format = "think" }}
        """)
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def sdk(served: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_a_chats_thinking_is_its_reasoning_content_whole_and_streamed(
        sdk: openai.OpenAI) -> None:
    asked: Any = {"model": MODEL, "messages": QUESTION, "temperature": 0, **HELD}
    message = sdk.chat.completions.create(**asked).choices[0].message
    assert message.content == "Paris."
    assert message.model_extra == {"reasoning_content": "The user wants a city."}
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(**asked, stream=True)
              if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == (
        "The user wants a city.")
    assert "".join(d.content or "" for d in deltas) == "Paris."
    thinking = [i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning_content")]
    said = [i for i, d in enumerate(deltas) if d.content]
    assert thinking and said and max(thinking) <= min(said)  # the thinking first


def test_a_thought_cut_short_is_all_thinking_through_the_sdk_and_the_socket(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """The template opened the thinking and the model never closed it: all of its
    output is thinking, as the socket client's chunks say too; a model that does not
    reason (tiny-llm, the same weights) gives the same text as its answer."""
    kw: Any = {"messages": QUESTION, "max_tokens": 10, **SAMPLED}
    choice = sdk.chat.completions.create(model=MODEL, **kw).choices[0]
    thought = (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.finish_reason == "length" and choice.message.content == "" and thought
    thinking = ("modelpool_generation_tokens_reasoning_total", (("model", MODEL),))
    before = _samples(served[1]).get(thinking, 0)
    used = sdk.chat.completions.create(model=MODEL, **kw).usage
    assert used is not None and used.completion_tokens_details is not None
    assert used.completion_tokens_details.reasoning_tokens == used.completion_tokens == 10
    assert _samples(served[1])[thinking] - before == 10  # /metrics counts them too
    with served[0].client() as client:
        chunks = list(client.generate(QUESTION, model=MODEL, max_tokens=10, **SAMPLED))
    assert "".join(c.reasoning for c in chunks) == thought
    assert "".join(c.text for c in chunks) == ""
    # vLLM's chat_template_kwargs turn the thinking off: what the model says is its answer
    off = sdk.chat.completions.create(model=MODEL, **kw, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert off.content and not (off.model_extra or {}).get("reasoning_content")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs: 'chat_template'"):
        sdk.chat.completions.create(model=MODEL, **kw, extra_body={
            "chat_template_kwargs": {"chat_template": "{{ 'mine' }}"}})
    # the command line: the thinking on stderr (stdout is the answer), and in --json lines
    argv = [sys.executable, "-m", "modelpool.supervisor.cli", "generate", "--model", MODEL,
            "--max-tokens", "10", "--temperature", "1.0", "--seed", "3",
            "--socket", served[0].socket_path, QUESTION[0]["content"]]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert plain.returncode == 0 and plain.stdout == "\n"
    assert plain.stderr.startswith(thought)
    lines = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT).stdout.splitlines()
    assert "".join(json.loads(line).get("reasoning", "") for line in lines) == thought
    assert json.loads(lines[-1])["reasoning_tokens"] == 10  # all of the 10 it made
    assert plain.stderr.endswith("+ 10 generated (10 thinking) tokens]\n")
    raw = sdk.completions.create(model=MODEL, prompt="<|im_start|>user\ntell me about "
                                 "workers<|im_end|>\n<|im_start|>assistant\n<think>\n",
                                 max_tokens=10, **SAMPLED).choices[0].text
    assert raw.strip() == thought  # a raw prompt's text is all text


def test_a_responses_thinking_is_its_reasoning_item_whole_streamed_and_in_the_background(
        sdk: openai.OpenAI) -> None:
    asked: Any = {"model": MODEL, "input": QUESTION, "max_output_tokens": 10,
                  **SAMPLED_RESPONSE}
    thought = (sdk.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=10, **SAMPLED).choices[0].message
        .model_extra or {})["reasoning_content"]
    whole = sdk.responses.create(**asked)
    assert whole.status == "incomplete" and [i.type for i in whole.output] == [
        "reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content is not None and reasoning.content[0].text == thought
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 10
    with sdk.responses.stream(**asked) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # cut at max_output_tokens
    streamed = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    assert [e.type for e in events if e.type.startswith("response.output_item")][:2] == [
        "response.output_item.added", "response.output_item.done"]  # the thinking's item
    assert [i.type for i in streamed.output] == ["reasoning", "message"]
    assert streamed.output[0].content is not None
    assert streamed.output[0].content[0].text == thought
    queued = sdk.responses.create(**asked, background=True)
    done = _ended(sdk, queued.id)
    assert [i.type for i in done.output] == ["reasoning", "message"]
    assert done.output[0].content is not None and done.output[0].content[0].text == thought
    assert done.usage is not None and done.usage.output_tokens_details.reasoning_tokens == 10


def test_a_reasoning_answer_is_continued_and_sent_back_as_input(sdk: openai.OpenAI) -> None:
    """Its reasoning item is taken back as input (left out of the conversation, as the
    reasoning templates leave out earlier thinking): continuing it by id and sending its
    items back are the same conversation."""
    first = sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6,
                                 **SAMPLED_RESPONSE)
    turn = {"role": "user", "content": "and then?"}
    by_id = sdk.responses.create(model=MODEL, input=[turn], previous_response_id=first.id,
                                 max_output_tokens=6, **SAMPLED_RESPONSE)
    sent_back = sdk.responses.create(
        model=MODEL, input=[*QUESTION, *(i.model_dump(exclude_none=True) for i in first.output),
                            turn], max_output_tokens=6, **SAMPLED_RESPONSE)
    assert by_id.output[0].type == sent_back.output[0].type == "reasoning"
    assert by_id.output[0].content == sent_back.output[0].content
    assert by_id.usage is not None and sent_back.usage is not None
    assert by_id.usage.input_tokens == sent_back.usage.input_tokens
    items = list(sdk.responses.input_items.list(by_id.id, order="asc"))
    assert [i.type for i in items] == ["message", "reasoning", "message", "message"]


HARMONY = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
           "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather "
           '<|constrain|>json<|message|>{"city": "Paris"}')


def test_gpt_oss_channels_are_its_thinking_its_answer_and_its_calls(sdk: openai.OpenAI) -> None:
    """A model whose template writes harmony's channels (gpt-oss's), held by a regex to a
    thought, a preamble and a call: chat's reasoning_content, content and tool_calls."""
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    asked: Any = {"model": "tiny-harmony", "messages": QUESTION, "tools": tools,
                  "temperature": 0, "extra_body": {"guided_regex": re.escape(HARMONY)}}
    choice = sdk.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.model_extra or {})["reasoning_content"] == "Need the weather."
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(**asked, stream=True)
              if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    pieces = [c for d in deltas for c in d.tool_calls or []]  # as the model wrote it
    assert [c.function.name for c in pieces[:2]] == ["get_weather", None]  # type: ignore[union-attr]
    assert "".join(c.function.arguments or "" for c in pieces) == call.function.arguments  # type: ignore[union-attr]


def test_reasoning_effort_reaches_a_template_that_reads_it(sdk: openai.OpenAI) -> None:
    """OpenAI's reasoning_effort (chat's, and the Responses API's reasoning.effort) goes
    to gpt-oss's template as its variable; a model whose template reads none refuses it."""
    asked: Any = {"model": "tiny-harmony", "messages": QUESTION, "max_tokens": 1}
    plain = sdk.chat.completions.create(**asked).usage
    high = sdk.chat.completions.create(**asked, reasoning_effort="high").usage
    assert plain is not None and high is not None
    assert high.prompt_tokens > plain.prompt_tokens  # "Reasoning: high" in its prompt
    response = sdk.responses.create(model="tiny-harmony", input=QUESTION, max_output_tokens=1,
                                    reasoning={"effort": "high"})
    assert response.reasoning is not None and response.reasoning.effort == "high"
    assert response.usage is not None and response.usage.input_tokens == high.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort="low")
    assert refused.value.body["param"] == "reasoning_effort"  # type: ignore[index]


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]


SCHEMA = {**City.model_json_schema(), "additionalProperties": False}
# Sampled, tiny-thinker closes its thinking within a few tens of tokens, biased to
CLOSING: Any = {"temperature": 1.0, "max_tokens": 64, "logit_bias": {"1025": 5}}


def test_structured_output_and_a_forced_call_come_after_free_thinking(
        sdk: openai.OpenAI) -> None:
    """The model thinks what it thinks (random tokens, in no language), then answers in
    the schema's: the SDK's parse, its stream, and a named function's call."""
    thoughts = []
    for seed in range(3):
        choice = sdk.chat.completions.parse(model=FIRST, messages=QUESTION, seed=seed,
                                            response_format=City, **CLOSING).choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
        thoughts.append((choice.message.model_extra or {}).get("reasoning_content") or "")
        deltas = [c.choices[0].delta for c in sdk.chat.completions.create(
            model=FIRST, messages=QUESTION, seed=seed, response_format={
                "type": "json_schema", "json_schema": {"name": "City", "schema": SCHEMA}},
            stream=True, **CLOSING) if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas
                       ) == thoughts[-1]
        assert City.model_validate_json("".join(d.content or "" for d in deltas))
    assert any(t and not t.startswith("{") for t in thoughts)
    tool: Any = {"type": "function", "function": {
        "name": "visit", "parameters": SCHEMA}}
    forced: Any = {"model": FIRST, "messages": QUESTION, "seed": 1, "tools": [tool],
                   "tool_choice": {"type": "function", "function": {"name": "visit"}},
                   **CLOSING}
    message = sdk.chat.completions.create(**forced).choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == thoughts[1]
    (call,) = message.tool_calls or []
    assert City.model_validate_json(call.function.arguments)
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(**forced, stream=True)
              if c.choices]
    calls = [(i, c) for i, d in enumerate(deltas) for c in d.tool_calls or []]
    thinking = [i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning_content")]
    assert thinking and max(thinking) < calls[0][0]  # the call begins once it has thought
    assert calls[0][1].id and calls[0][1].function.name == "visit"
    assert "".join(c.function.arguments or "" for _, c in calls) == call.function.arguments


def test_a_forced_calls_item_follows_the_thinkings(sdk: openai.OpenAI) -> None:
    """The Responses API, a named function forced, the output cut short while it thinks:
    the call's item is added once the reasoning item is done, not beside it."""
    with sdk.responses.stream(model=FIRST, input=QUESTION, max_output_tokens=6,
                              tools=[{"type": "function", "name": "visit",
                                      "parameters": SCHEMA}],
                              tool_choice={"type": "function", "name": "visit"},
                              **SAMPLED_RESPONSE) as stream:
        events = [(e.type, getattr(e, "item", None)) for e in stream]
    items = [(kind, item.type) for kind, item in events if kind.startswith("response.output_item")]
    assert items == [("response.output_item.added", "reasoning"),
                     ("response.output_item.done", "reasoning"),
                     ("response.output_item.added", "function_call"),
                     ("response.output_item.done", "function_call")]


@pytest.mark.parametrize("model", ["vision-thinker", "vision-thinker-alone"])
def test_a_vision_models_thinking_is_apart_through_the_socket_and_chat(
        served: tuple[Daemon, str], sdk: openai.OpenAI, model: str) -> None:
    """Its template opened the thinking and it never closed it: all thinking, counted so,
    through a real worker, the socket client and the SDK's chat with an image; decoded
    continuously batched, or one request at a time (max_active_sequences = 1)."""
    image = png((255, 0, 0))
    with served[0].client() as client:
        chunks = list(client.describe(image, "what is it?", model=model,
                                      max_tokens=6, **SAMPLED))
    thought = "".join(c.reasoning for c in chunks)
    assert thought and "".join(c.text for c in chunks) == ""
    assert chunks[-1].reasoning_tokens == chunks[-1].completion_tokens == 6
    reply = sdk.chat.completions.create(model=model, max_tokens=6, **SAMPLED,
                                        messages=[{"role": "user", "content": [
                                            {"type": "text", "text": "what is it?"},
                                            {"type": "image_url",
                                             "image_url": {"url": data_url(image)}}]}])
    assert (reply.choices[0].message.model_extra or {})["reasoning_content"] == thought
    assert reply.choices[0].message.content == ""
