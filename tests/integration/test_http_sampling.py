"""Sampling through the OpenAI-compatible HTTP API with the official `openai` package:
OpenAI's fields and vLLM's extensions (in the SDK's `extra_body`) answer as the socket
client's same request does, on the tiny random-weight Llama; structured output too."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx2 as httpx
import openai
import pydantic
import pytest
from conftest import Daemon
from http_helpers import KEY, http_daemon, long_llm


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    daemon, base = http_daemon(tmp_path_factory.mktemp("http-sampling"), tiny_models_dir,
                               extra=long_llm(tiny_models_dir))
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def sdk(served: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_top_k_narrows_sampling_through_the_sdk_and_the_socket_client(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """top_k 1 is greedy at any temperature; vLLM's extension, in the SDK's extra_body."""
    messages = [{"role": "user", "content": "tell me about workers"}]
    with served[0].client() as c:
        greedy = "".join(ch.text for ch in c.generate(messages, model="tiny-llm",
                                                      max_tokens=12, temperature=0))
        narrowed = "".join(ch.text for ch in c.generate(
            messages, model="tiny-llm", max_tokens=12, temperature=1.5, seed=3, top_k=1))
    assert narrowed == greedy
    replies = {sdk.chat.completions.create(
        model="tiny-llm", messages=messages, max_tokens=12, temperature=1.5, seed=seed,
        extra_body=extra).choices[0].message.content for seed in (4, 5)
        for extra in ({"top_k": 1}, {"min_p": 1.0})}
    assert replies == {greedy}


def test_penalties_through_the_sdk_equal_the_socket_clients(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """OpenAI's presence and frequency penalties, and vLLM's repetition_penalty in the
    SDK's extra_body, steer greedy decoding as the socket client's do."""
    messages = [{"role": "user", "content": "tell me about workers"}]
    openais = {"frequency_penalty": 1.0, "presence_penalty": 0.5}
    with served[0].client() as c:
        texts = ["".join(ch.text for ch in c.generate(
            messages, model="tiny-llm", max_tokens=16, temperature=0, **penalties))
            for penalties in ({}, openais, {"repetition_penalty": 2.0})]
    greedy, penalized, repeated = texts
    assert penalized != greedy and repeated != greedy
    assert sdk.chat.completions.create(
        model="tiny-llm", messages=messages, max_tokens=16, temperature=0,
        **openais).choices[0].message.content == penalized  # type: ignore[call-overload]
    assert sdk.chat.completions.create(
        model="tiny-llm", messages=messages, max_tokens=16, temperature=0,
        extra_body={"repetition_penalty": 2.0}).choices[0].message.content == repeated
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        sdk.chat.completions.create(model="tiny-llm", messages=messages, presence_penalty=3)


def test_n_choices_whole_and_streamed_are_the_seeded_requests_alone(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """Choice i of a seeded request is the same request alone with seed + i; the prompt
    is counted once, the completions of them all."""
    messages = [{"role": "user", "content": "tell me about workers"}]
    kw: dict[str, Any] = {"max_tokens": 10, "temperature": 1.0}
    with served[0].client() as c:
        alone = [list(c.generate(messages, model="tiny-llm", seed=40 + i, **kw))
                 for i in range(3)]
    whole = sdk.chat.completions.create(model="tiny-llm", messages=messages, n=3, seed=40,
                                        **kw)
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    texts = ["".join(c.text for c in chunks) for chunks in alone]
    assert [ch.message.content for ch in whole.choices] == texts
    assert len(set(texts)) > 1  # sampled with different seeds
    assert whole.usage.prompt_tokens == alone[0][-1].prompt_tokens
    assert whole.usage.completion_tokens == sum(a[-1].completion_tokens for a in alone)
    stream = sdk.chat.completions.create(model="tiny-llm", messages=messages, n=3, seed=40,
                                         stream=True, stream_options={"include_usage": True},
                                         **kw)
    streamed, usages = ["", "", ""], []
    for part in stream:
        for choice in part.choices:
            streamed[choice.index] += choice.delta.content or ""
        usages += [part.usage] if part.usage else []
    assert streamed == texts
    assert [u.completion_tokens for u in usages] == [whole.usage.completion_tokens]


def test_vllms_stop_token_ids_and_min_tokens_through_the_sdk(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """A bias makes token 100 every token; as a stop token it ends the completion at
    once, unseen, or once min_tokens are out."""
    kw: dict[str, Any] = {"model": "tiny-llm", "prompt": "tell me about workers",
                          "max_tokens": 12, "temperature": 0, "logit_bias": {"100": 100}}
    forced = sdk.completions.create(**kw)
    assert forced.choices[0].finish_reason == "length" and forced.choices[0].text
    stopped = sdk.completions.create(**kw, extra_body={"stop_token_ids": [7, 100]})
    assert (stopped.choices[0].finish_reason, stopped.choices[0].text) == ("stop", "")
    assert stopped.usage.completion_tokens == 0
    held = sdk.completions.create(**kw, extra_body={"stop_token_ids": [100], "min_tokens": 4})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


def test_a_logit_bias_through_the_sdk_steers_as_the_socket_clients_does(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    prompt = "tell me about workers"
    with served[0].client() as c:
        texts = ["".join(ch.text for ch in c.generate(
            prompt, model="tiny-llm", max_tokens=8, temperature=0, raw=True, **bias))
            for bias in ({}, {"logit_bias": {100: 100.0}})]
    assert texts[1] != texts[0]
    biased = sdk.completions.create(model="tiny-llm", prompt=prompt, max_tokens=8,
                                    temperature=0, logit_bias={"100": 100})
    assert biased.choices[0].text == texts[1]
    with pytest.raises(openai.BadRequestError, match="logit_bias names token 99999999"):
        sdk.completions.create(model="tiny-llm", prompt=prompt, max_tokens=8,
                               logit_bias={"99999999": 1})


def test_logprobs_through_the_sdk_are_the_socket_clients_whole_and_streamed(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """Chat's logprobs with top_logprobs, and the completions API's logprobs N: one entry
    per output token, as the socket client gets them; greedy picks the likeliest."""
    messages = [{"role": "user", "content": "tell me about workers"}]
    kw: dict[str, Any] = {"model": "tiny-llm", "max_tokens": 10, "temperature": 0}
    with served[0].client() as c:
        chunks = list(c.generate(messages, logprobs=2, **kw))
    entries = [e for ch in chunks for e in ch.logprobs or []]
    assert len(entries) == chunks[-1].completion_tokens == 10
    whole = sdk.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw)
    content = whole.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [(e.token, e.logprob) for e in entries]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
               for t in content)
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert bytes(content[0].bytes or []) == content[0].token.encode()
    stream = sdk.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2,
                                         stream=True, **kw)
    streamed = [t for part in stream for choice in part.choices if choice.logprobs
                for t in choice.logprobs.content or []]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    plain = sdk.chat.completions.create(messages=messages, **kw)
    assert plain.choices[0].logprobs is None
    legacy = sdk.completions.create(prompt="tell me about workers", logprobs=3, **kw)
    listed = legacy.choices[0].logprobs
    assert listed is not None and len(listed.tokens or []) == 10
    assert "".join(listed.tokens or []) == legacy.choices[0].text
    assert listed.text_offset == [sum(len(t) for t in (listed.tokens or [])[:i])
                                  for i in range(10)]
    assert all(len(top) >= 3 and top[token] == lp for top, token, lp in zip(
        listed.top_logprobs or [], listed.tokens or [], listed.token_logprobs or [],
        strict=True))
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        sdk.chat.completions.create(messages=messages, top_logprobs=2, **kw)


def test_an_echoed_prompts_logprobs_through_the_sdk_as_evaluation_harnesses_ask(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """lm-evaluation-harness scores a continuation by asking for the prompt echoed with its
    logprobs and one token: the prompt's tokens come first (the first without one), as
    the socket client's prompt_logprobs give them, then the generated token."""
    prompt = "tell me about workers"
    with served[0].client() as c:
        chunks = list(c.generate(prompt, model="tiny-llm", raw=True, max_tokens=1,
                                 temperature=0, logprobs=1, prompt_logprobs=1))
    prompt_entries = chunks[-1].prompt_logprobs or []
    generated = [e for ch in chunks for e in ch.logprobs or []]
    assert len(prompt_entries) == chunks[-1].prompt_tokens and len(generated) == 1
    echoed = sdk.completions.create(model="tiny-llm", prompt=prompt, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0)
    choice = echoed.choices[0]
    assert choice.text == prompt + generated[0].token
    listed = choice.logprobs
    assert listed is not None and listed.top_logprobs is not None
    assert listed.tokens == [e.token for e in [*prompt_entries, *generated]]
    assert listed.token_logprobs == [e.logprob for e in [*prompt_entries, *generated]]
    assert listed.token_logprobs[0] is None and listed.top_logprobs[0] is None
    assert all(-100 < lp < 0 for lp in listed.token_logprobs[1:] if lp is not None)
    ids = [e.token_id for e in prompt_entries]  # as the harness sends them by default
    tokenized = sdk.completions.create(model="tiny-llm", prompt=ids, echo=True, logprobs=1,
                                       max_tokens=1, temperature=0).choices[0]
    assert tokenized.logprobs == listed and tokenized.text == "".join(listed.tokens)
    plain = sdk.completions.create(model="tiny-llm", prompt=prompt, echo=True, max_tokens=1,
                                   temperature=0)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="echo"):  # its logprobs come last
        sdk.completions.create(model="tiny-llm", prompt=prompt, echo=True, logprobs=1,
                               stream=True)
    batch = sdk.completions.create(model="tiny-llm", prompt=[ids, ids[:3]], echo=True,
                                   logprobs=1, max_tokens=1, temperature=0)
    assert batch.choices[0].logprobs == listed  # a batch of them, as the harness sends
    assert batch.choices[1].logprobs.tokens[:3] == listed.tokens[:3]  # type: ignore[union-attr]


def test_a_streamed_echo_starts_each_choice_with_its_prompt(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    prompts = ["tell me about workers", "a pool"]
    whole = sdk.completions.create(model="tiny-llm", prompt=prompts, n=2, echo=True,
                                   max_tokens=6, temperature=0)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [t[:len(prompts[i // 2])] for i, t in enumerate(texts)] == [
        prompts[0], prompts[0], prompts[1], prompts[1]]
    assert all(len(t) > len(prompts[i // 2]) for i, t in enumerate(texts))
    streamed = ["", "", "", ""]
    for chunk in sdk.completions.create(model="tiny-llm", prompt=prompts, n=2, echo=True,
                                        max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_several_prompts_in_one_body_are_each_the_socket_clients_request(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """A list of prompts: n choices for each, in prompt order, each the socket client's
    same request (seeded: choice j of a prompt takes seed + j); usage counts each prompt
    once; streamed alike."""
    prompts = ["tell me about workers", "a pool of models", "once upon"]
    with served[0].client() as c:
        runs = [[list(c.generate(p, model="tiny-llm", raw=True, max_tokens=6,
                                 temperature=1.0, seed=7 + j)) for j in range(2)]
                for p in prompts]
    alone = [["".join(ch.text for ch in run) for run in pair] for pair in runs]
    prompt_tokens = sum(pair[0][-1].prompt_tokens or 0 for pair in runs)
    kw: dict[str, Any] = {"model": "tiny-llm", "prompt": prompts, "n": 2, "max_tokens": 6,
                          "temperature": 1.0, "seed": 7}
    whole = sdk.completions.create(**kw)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [t for pair in alone for t in pair]
    assert whole.usage is not None and whole.usage.prompt_tokens == prompt_tokens
    streamed: dict[int, str] = {}
    for part in sdk.completions.create(**kw, stream=True):
        for choice in part.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in whole.choices}


class Verdict(pydantic.BaseModel):
    ok: bool
    tag: Literal["red", "green"]
    score: int = pydantic.Field(ge=0, le=99)


def test_structured_output_through_the_sdks_parse_and_vllms_fields(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """The SDK's `parse` (a strict json_schema response_format from a pydantic model)
    gets an object of that model, as the socket client's same schema does; vLLM's
    fields hold completions, streamed or not; a schema that is none is a 400."""
    messages = [{"role": "user", "content": "judge this"}]
    parsed = sdk.chat.completions.parse(model="tiny-llm", messages=messages, max_tokens=60,
                                        temperature=0, response_format=Verdict)
    choice = parsed.choices[0]
    assert isinstance(choice.message.parsed, Verdict) and choice.finish_reason == "stop"
    schema = openai.lib._pydantic.to_strict_json_schema(Verdict)
    with served[0].client() as c:
        same = "".join(ch.text for ch in c.generate(
            messages, model="tiny-llm", max_tokens=60, temperature=0, json_schema=schema))
    assert choice.message.content == same
    kw: dict[str, Any] = {"model": "tiny-llm", "prompt": "code:", "max_tokens": 30,
                          "temperature": 1.0, "seed": 4}
    coded = sdk.completions.create(**kw, extra_body={
        "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}).choices[0].text
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", coded)
    streamed = "".join(part.choices[0].text for part in sdk.completions.create(
        **kw, stream=True, extra_body={"guided_choice": ["alpha", "beta gamma"]}))
    assert streamed in ("alpha", "beta gamma")
    with pytest.raises(openai.BadRequestError, match="structured output"):
        sdk.chat.completions.create(model="tiny-llm", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    with pytest.raises(openai.BadRequestError) as two:
        sdk.chat.completions.create(model="tiny-llm", messages=messages,
                                    response_format={"type": "json_object"},
                                    extra_body={"guided_regex": "a"})
    assert two.value.body["param"] == "response_format"


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    celsius: bool


def test_function_calling_through_the_sdks_parse_named_required_and_streamed(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """A named function (what instructor and LangChain's structured output send) comes
    back as a tool call the SDK's parse turns into the pydantic model, its arguments the
    socket client's same schema's output with the tools in the template; "required"
    gives a list of calls; a named call streams its arguments."""
    messages = [{"role": "user", "content": "weather?"}]
    tool = openai.pydantic_function_tool(Weather)
    named: Any = {"type": "function", "function": {"name": "Weather"}}
    parsed = sdk.chat.completions.parse(model="tiny-llm-long", messages=messages, tools=[tool],
                                        tool_choice=named, max_tokens=40, temperature=0)
    choice = parsed.choices[0]
    (call,) = choice.message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)
    assert choice.message.content is None and choice.finish_reason == "stop"
    with served[0].client() as c:
        same = "".join(ch.text for ch in c.generate(
            messages, model="tiny-llm-long", max_tokens=40, temperature=0, tools=[tool],
            json_schema=tool["function"]["parameters"]))
    assert call.function.arguments == same
    listed = sdk.chat.completions.create(model="tiny-llm-long", messages=messages, tools=[tool],
                                         tool_choice="required", max_tokens=80,
                                         temperature=0.8, seed=2, parallel_tool_calls=False)
    assert listed.choices[0].finish_reason == "tool_calls"
    (one,) = listed.choices[0].message.tool_calls or []
    Weather.model_validate_json(one.function.arguments)  # type: ignore[union-attr]
    streamed = "".join(  # the last delta is empty, as OpenAI's is
        call.function.arguments or "" for part in sdk.chat.completions.create(
            model="tiny-llm-long", messages=messages, tools=[tool], tool_choice=named,
            max_tokens=40, temperature=0, stream=True)
        if part.choices for call in part.choices[0].delta.tool_calls or []
        if call.function is not None)
    assert streamed == same


CALLED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}\n</tool_call>')
GET_WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_auto_tool_calls_through_the_sdk_whole_streamed_answered_and_as_a_job(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """tool_choice "auto" (the default with tools): the model's calls in its own format
    (the tiny model's template is Qwen's, Hermes' <tool_call>) come back as tool calls
    beside its text. The tiny model is held to a call by a regex: what a model that
    chose to call writes. The conversation then goes on with the call's answer."""
    messages: Any = [{"role": "user", "content": "weather in Paris?"}]
    asked: Any = {"model": "tiny-llm-long", "messages": messages, "tools": [GET_WEATHER],
                  "max_tokens": 80, "temperature": 0,
                  "extra_body": {"guided_regex": re.escape(CALLED)}}
    choice = sdk.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    parts = [p.choices[0] for p in sdk.chat.completions.create(**asked, stream=True)
             if p.choices]
    assert "".join(p.delta.content or "" for p in parts) == "Let me check.\n"
    assert parts[-1].finish_reason == "tool_calls"
    pieces = [c for p in parts for c in p.delta.tool_calls or []]  # as the model wrote them
    first, *rest = pieces
    assert first.index == 0 and (first.id or "").startswith("call_")
    assert first.function.name == "get_weather"  # type: ignore[union-attr]
    assert len(rest) > 2 and all(c.id is None for c in rest)
    assert json.loads("".join(c.function.arguments or "" for c in pieces)) == {  # type: ignore[union-attr]
        "city": "Paris"}
    with served[0].client() as c:  # the socket client's last chunk holds the calls
        *_, last = c.generate(messages, model="tiny-llm-long", tools=[GET_WEATHER],
                              tool_choice="auto", regex=re.escape(CALLED), temperature=0)
    assert last.finish_reason == "tool_calls" and [(t.name, json.loads(t.arguments))
                                                   for t in last.tool_calls or []] == [
        ("get_weather", {"city": "Paris"})]

    answered = [*messages, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    reply = sdk.chat.completions.create(model="tiny-llm-long", messages=answered,
                                        tools=[GET_WEATHER], max_tokens=8, temperature=0)
    with served[0].client() as c:
        pool_chat = [*messages, {"role": "assistant", "content": "Let me check.\n",
                                 "tool_calls": [{"name": "get_weather", "arguments":
                                                 call.function.arguments}]},  # type: ignore[union-attr]
                     {"role": "tool", "content": "sunny, 21 C"}]
        *pieces, end = list(c.generate(pool_chat, model="tiny-llm-long", tools=[GET_WEATHER],
                                       max_tokens=8, temperature=0))
    assert reply.usage is not None and reply.usage.prompt_tokens == end.prompt_tokens > 100
    assert reply.choices[0].message.content == "".join(p.text for p in [*pieces, end])

    auth = {"Authorization": f"Bearer {KEY}"}
    job = httpx.post(served[1] + "/v1/jobs", headers=auth, json={
        "operation": "chat.completions", "body": {**{k: v for k, v in asked.items()
                                                    if k != "extra_body"},
                                                 "guided_regex": re.escape(CALLED)}})
    assert job.status_code == 202, job.text
    result = httpx.get(f"{served[1]}/v1/jobs/{job.json()['id']}?wait=30", headers=auth,
                       timeout=60).json()["result"]
    assert result["finish_reason"] == "tool_calls" and result["text"] == "Let me check.\n"
    assert [c["function"]["name"] for c in result["tool_calls"]] == ["get_weather"]
