"""The HTTP API without a server: bodies into pool calls, errors into statuses, streamed
chunks into events, the status into Prometheus text, and the start-up checks."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httptools
import msgspec
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from modelpool.protocol.client_core import TextChunk
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.config import Config, ConfigError, HttpConfig
from modelpool.supervisor.http_front import listen_address, settings_of
from modelpool.supervisor.httpapi import bodies, completions, guard, replies, routes
from modelpool.supervisor.httpapi.chat import chat_call
from modelpool.supervisor.httpapi.exposition import HttpCounters, exposition
from modelpool.supervisor.httpapi.plumbing import with_header_options
from modelpool.supervisor.httpapi.serve import Server
from modelpool.supervisor.httpapi.settings import HttpSettings
from modelpool.supervisor.metrics import Histogram, ModelMetrics


def body(kind: type, **fields: object) -> object:
    return msgspec.convert(fields, type=kind, str_keys=True)  # as JSON gives them


def test_embeddings_take_one_text_or_many_and_refuse_tokens() -> None:
    one = bodies.embeddings_call(body(bodies.EmbeddingsBody, input="a", model="m",
                                      priority="high"))
    assert one == bodies.PoolCall("embed", (["a"],), {"model": "m", "dimensions": None,
                                                      "priority": "high"})
    with pytest.raises(PoolError, match="token arrays"):
        bodies.embeddings_call(body(bodies.EmbeddingsBody, input=[1, 2]))
    shortened = bodies.embeddings_call(body(bodies.EmbeddingsBody, input="a", dimensions=8))
    assert shortened.kwargs["dimensions"] == 8  # the worker knows whether its model can
    with pytest.raises(msgspec.ValidationError, match="dimensions"):
        body(bodies.EmbeddingsBody, input="a", dimensions=0)


def test_what_would_be_dropped_silently_is_refused_by_name() -> None:
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: echo: streamed without logprobs"):
        completions.completion_call(body(bodies.CompletionBody, prompt="p", echo=True,
                                    stream=True, logprobs=0))
    streamed = completions.completion_call(body(bodies.CompletionBody, prompt="p", echo=True,
                                                stream=True))
    assert streamed.kwargs["prompt_logprobs"] is None
    with pytest.raises(PoolError, match="response_format"):
        bodies.images_call(body(bodies.ImagesBody, prompt="x", response_format="url"))
    with pytest.raises(PoolError, match="size"):
        bodies.images_call(body(bodies.ImagesBody, prompt="x", size="huge"))
    sized = bodies.images_call(body(bodies.ImagesBody, prompt="x", size="64x32"))
    assert (sized.kwargs["width"], sized.kwargs["height"]) == (64, 32)
    assert completions.completion_call(body(bodies.CompletionBody, prompt=["p"])).kwargs["raw"]


CHAT = {"messages": [{"role": "user", "content": "x"}]}
ASKING = [  # a body, then each field with a value that asks for what no model here does
    (bodies.ChatBody, CHAT, {
        "functions": [{"name": "f"}],
        "function_call": {"name": "f"},
        "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}),
    (bodies.CompletionBody, {"prompt": "p"}, {
        "top_logprobs": 3, "suffix": "end", "best_of": 2}),
    (bodies.ImagesBody, {"prompt": "p"}, {
        "n": 2, "response_format": "url", "output_format": "jpeg",
        "background": "transparent"}),
    (bodies.EmbeddingsBody, {"input": "a"}, {}),
]
CALLS = {bodies.ChatBody: chat_call, bodies.CompletionBody: completions.completion_call,
         bodies.ImagesBody: bodies.images_call, bodies.EmbeddingsBody: bodies.embeddings_call}


@pytest.mark.parametrize(("kind", "base", "field", "value"), [
    (kind, base, field, value) for kind, base, asking in ASKING
    for field, value in asking.items()])
def test_a_field_no_model_here_honours_is_refused_by_name(
        kind: type, base: dict, field: str, value: object) -> None:
    with pytest.raises(PoolError, match=rf"^BAD_REQUEST: {field}: "):
        CALLS[kind](body(kind, **base, **{field: value}))


def test_every_field_a_body_refuses_is_tried_above() -> None:
    assert {kind: set(kind.refused) for kind in CALLS} == {
        kind: set(asking) for kind, _, asking in ASKING}


def test_what_asks_for_nothing_is_taken() -> None:
    """The values clients send as defaults are no request: they pass."""
    chat = chat_call(body(bodies.ChatBody, **CHAT, n=1, logprobs=False,
                                 presence_penalty=0, frequency_penalty=0.0,
                                 repetition_penalty=1.0, logit_bias={},
                                 tools=[], tool_choice="none", function_call="auto",
                                 response_format={"type": "text"}, modalities=["text"]))
    assert chat.op == "generate"
    completion = completions.completion_call(body(bodies.CompletionBody, prompt="p", best_of=1,
                                             echo=False, suffix=""))
    assert completion.args == ("p",)
    image = bodies.images_call(body(bodies.ImagesBody, prompt="p", output_format="png",
                                    background="opaque"))
    assert image.op == "generate_image"


def test_vllms_top_k_and_min_p_reach_the_sampler() -> None:
    chat = chat_call(body(bodies.ChatBody, **CHAT, top_k=5, min_p=0.1))
    assert (chat.kwargs["top_k"], chat.kwargs["min_p"]) == (5, 0.1)
    for everything in (-1, 0):  # vLLM's -1: every token
        completion = completions.completion_call(body(bodies.CompletionBody, prompt="p",
                                                 top_k=everything, min_p=0))
        assert (completion.kwargs["top_k"], completion.kwargs["min_p"]) == (0, 0.0)
    unset = completions.completion_call(body(bodies.CompletionBody, prompt="p"))
    assert (unset.kwargs["top_k"], unset.kwargs["min_p"]) == (None, None)  # the defaults
    for out_of_range in (-2, 2**31, 10**23):  # one the wire could not carry, too
        with pytest.raises(msgspec.ValidationError, match="top_k"):
            body(bodies.ChatBody, **CHAT, top_k=out_of_range)
    with pytest.raises(msgspec.ValidationError, match="min_p"):
        body(bodies.ChatBody, **CHAT, min_p=1.5)


def test_vllms_stop_token_ids_reach_the_sampler() -> None:
    chat = chat_call(body(bodies.ChatBody, **CHAT, stop_token_ids=[2, 128009]))
    assert chat.kwargs["stop_token_ids"] == [2, 128009]
    assert chat_call(body(bodies.ChatBody, **CHAT)).kwargs["stop_token_ids"] is None
    for wrong in ([-1], list(range(65))):
        with pytest.raises(msgspec.ValidationError, match="stop_token_ids"):
            body(bodies.ChatBody, **CHAT, stop_token_ids=wrong)


def test_penalties_and_biases_reach_the_sampler_within_their_bounds() -> None:
    penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    chat = chat_call(body(bodies.ChatBody, **CHAT, presence_penalty=0.5,
                                 frequency_penalty=-1.0, repetition_penalty=1.1,
                                 logit_bias={"50256": -100, "7": 2.5}))
    assert [chat.kwargs[name] for name in penalties] == [0.5, -1.0, 1.1,
                                                         {50256: -100.0, 7: 2.5}]
    unset = completions.completion_call(body(bodies.CompletionBody, prompt="p"))
    assert [unset.kwargs[name] for name in penalties] == [None] * 4  # the defaults
    for name, out_of_range in (("presence_penalty", 2.5), ("frequency_penalty", -3),
                               ("repetition_penalty", 0), ("repetition_penalty", 5e-324),
                               ("logit_bias", {"7": 101}), ("logit_bias", {"x": 1}),
                               ("logit_bias", {"-1": 1}),
                               ("logit_bias", {str(i): 1 for i in range(1025)})):
        with pytest.raises(msgspec.ValidationError, match=name):
            body(bodies.ChatBody, **CHAT, **{name: out_of_range})


@pytest.mark.parametrize("size", ["100x100", "4x4", "8x4104", "64x", "ax64"])
def test_an_image_size_the_pipeline_cannot_make_is_refused_as_size(size: str) -> None:
    with pytest.raises(PoolError, match=r"^BAD_REQUEST: size: .*multiple of 8 from 8 to 4096"):
        bodies.images_call(body(bodies.ImagesBody, prompt="x", size=size))


def test_the_pools_own_bounds_are_checked_on_the_fields_the_client_sent() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"length <= 16 - at `\$.stop`"):
        body(bodies.ChatBody, **CHAT, stop=[str(i) for i in range(17)])
    with pytest.raises(msgspec.ValidationError, match=r"<= 1000 - at `\$.steps`"):
        body(bodies.ImagesBody, prompt="x", steps=1001)


@pytest.mark.parametrize(("code", "status"), [
    (ErrorCode.UNKNOWN_MODEL, 404), (ErrorCode.BAD_REQUEST, 400), (ErrorCode.QUEUE_FULL, 429),
    (ErrorCode.OVERLOADED, 429), (ErrorCode.INSUFFICIENT_MEMORY, 503),
    (ErrorCode.SHUTTING_DOWN, 503), (ErrorCode.TIMEOUT, 504),
    (ErrorCode.DEADLINE_EXPIRED, 504), (ErrorCode.MODEL_ERROR, 500)])
def test_error_codes_have_their_statuses(code: ErrorCode, status: int) -> None:
    got, payload, headers = replies.pool_error(PoolError(code, "input: bad", 2.5))
    error = json.loads(payload)["error"]
    assert got == status and error["code"] == code.value.lower()
    assert (headers.get("Retry-After") == "3") == (status in (429, 503))
    assert error["param"] == ("input" if code is ErrorCode.BAD_REQUEST else None)


def test_every_error_code_has_a_status() -> None:
    assert set(replies.STATUS) == set(ErrorCode)


@pytest.mark.parametrize("status", [408, 431, 503])
def test_the_guards_own_answers_are_well_formed_http(status: int) -> None:
    """Written to the transport by guard.py, past uvicorn: parsed by httptools here."""
    class Seen:
        def __init__(self) -> None:
            self.headers: dict[bytes, bytes] = {}
            self.body, self.complete = b"", False

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers[name.lower()] = value

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            self.complete = True

    seen = Seen()
    parser = httptools.HttpResponseParser(seen)
    parser.feed_data(guard.raw_error(status, "why", "some_code"))
    assert parser.get_status_code() == status and seen.complete
    assert seen.headers[b"connection"] == b"close"
    assert (b"retry-after" in seen.headers) == (status == 503)
    error = json.loads(seen.body)["error"]
    assert error["code"] == "some_code" and error["message"] == "why"
    assert error["type"] == ("service_unavailable" if status == 503 else
                             "invalid_request_error")


def test_a_stream_is_chunks_then_usage() -> None:
    shape = replies.StreamShape(chat=True, model="m", include_usage=True)
    first = shape.event(TextChunk("Hel"))
    last = shape.event(TextChunk("lo", "length", 3, 2))
    events = [json.loads(e.removeprefix(b"data: ")) for e in (first + last).split(b"\n\n")
              if e]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert events[1]["choices"][0] == {"index": 0, "finish_reason": "length",
                                       "delta": {"content": "lo"}, "logprobs": None}
    assert events[2]["choices"] == [] and events[2]["usage"]["total_tokens"] == 5
    assert len({e["id"] for e in events}) == 1


def test_histograms_are_cumulative() -> None:
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.5, 5.0):
        histogram.observe(value)
    assert histogram.totals().counts == [1, 2] and histogram.count == 3


def test_metrics_text_parses_with_prometheus_own_parser() -> None:
    metrics = ModelMetrics()
    metrics.ended("embed", "normal", object(), 0.02)
    metrics.rejected("embed", "low", ErrorCode.QUEUE_FULL)
    metrics.batch(4)
    metrics.queue_wait_s.observe(0.001)
    metrics.queue_wait_s.observe(0.002)
    status = {"uptime_s": 1.0, "shutting_down": False, "clients": None,
              "memory": {"budget_mb": 100.0, "used_mb": 10.0, "available_mb": 50.0},
              "models": [{"key": "m", "state": "ready", "queued": 1, "running": 2,
                          "memory_mb": 10.0, "workers": [{"state": "busy"}],
                          "totals": msgspec.to_builtins(metrics.totals())}]}
    families = {f.name: f for f in text_string_to_metric_families(
        exposition(status, HttpCounters()).decode())}
    outcomes = {(s.labels["code"], s.labels["priority"]): s.value
                for s in families["modelpool_requests"].samples}
    assert outcomes == {("OK", "normal"): 1, ("QUEUE_FULL", "low"): 1}
    latency = families["modelpool_request_duration_seconds"]
    assert latency.type == "histogram"
    assert {s.name: s.value for s in latency.samples if "le" not in s.labels or
            s.labels["le"] == "+Inf"}["modelpool_request_duration_seconds_count"] == 1
    assert families["modelpool_memory_budget_bytes"].samples[0].value == 100 * 1024 * 1024
    busy = [s for s in families["modelpool_workers"].samples if s.labels["state"] == "busy"]
    assert busy[0].value == 1


def test_an_open_port_beyond_loopback_needs_keys(tmp_path: Path) -> None:
    def config(**http: object) -> Config:
        return Config(http=HttpConfig(**http))  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match="api_keys"):
        settings_of(config(listen="0.0.0.0:8000"), "/s")
    assert settings_of(config(listen="127.0.0.1:8000"), "/s").api_keys == []
    assert settings_of(config(listen="[::1]:8000"), "/s").api_keys == []
    keys = tmp_path / "keys"
    keys.write_text("# ours\nk1\n\nk2\n")
    opened = settings_of(config(listen="0.0.0.0:8000", api_key_file=str(keys)), "/s")
    assert opened.api_keys == ["k1", "k2"]
    assert listen_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        listen_address("8000")


def test_each_api_keys_generations_keep_their_prompts_to_themselves() -> None:
    """With keys, a generation's cache salt is its key's (hashed) joined to its own; the
    socket-level call of any other kind carries none."""
    def salts(settings: HttpSettings, key: str, salt: str = "") -> str:
        request = Request({"type": "http", "headers": [(b"authorization",
                                                        f"Bearer {key}".encode())]})
        chat = chat_call(body(bodies.ChatBody, cache_salt=salt,
                                     messages=[{"role": "user", "content": "hi"}]))
        return with_header_options(request, chat.kwargs, settings)["cache_salt"]

    keyed = HttpSettings(socket_path="/s", api_keys=["k1", "k2"])
    one, two = salts(keyed, "k1"), salts(keyed, "k2")
    assert one == salts(keyed, "k1") != two
    assert "k1" not in one and len(one) == 32
    assert salts(keyed, "k1", "a") not in (one, two, salts(keyed, "k1", "b"))
    assert salts(keyed, "k1", "x" * 256) != salts(keyed, "k2", "x" * 256)
    assert len(salts(keyed, "k1", "x" * 256)) == 32  # within the protocol's 256
    shared = msgspec.structs.replace(keyed, prefix_cache_per_key=False)
    assert salts(shared, "k1") == salts(shared, "k2") == ""
    assert salts(shared, "k1", "a") == "a"
    assert salts(HttpSettings(socket_path="/s"), "", "a") == "a"  # no keys: one tenant
    request = Request({"type": "http", "headers": [(b"authorization", b"Bearer k1")]})
    embed = bodies.embeddings_call(body(bodies.EmbeddingsBody, input="a"))
    assert "cache_salt" not in with_header_options(request, embed.kwargs, keyed)
    assert settings_of(Config(http=HttpConfig(listen="127.0.0.1:8000",
                                                  prefix_cache_per_key=False)),
                       "/s").prefix_cache_per_key is False


def test_each_http_client_names_its_own_tenant_in_the_queues() -> None:
    """By key, else by address: a turn of its own whichever connection it shares."""
    def tenant(headers: list[tuple[bytes, bytes]], host: str = "127.0.0.1") -> str:
        request = Request({"type": "http", "headers": headers, "client": (host, 5)})
        call = bodies.embeddings_call(body(bodies.EmbeddingsBody, input="a"))
        return with_header_options(request, call.kwargs, HttpSettings(socket_path="/s"))[
            "tenant"]

    one, two = tenant([(b"authorization", b"Bearer k1")]), tenant([(b"authorization",
                                                                      b"Bearer k2")])
    assert one != two and one == tenant([(b"authorization", b"Bearer k1")], "10.0.0.9")
    assert "k1" not in one and len(one) <= 64  # the protocol's cap
    assert tenant([]) == tenant([], "127.0.0.1") != tenant([], "10.0.0.9")


def test_a_route_takes_its_parameters_from_whole_segments() -> None:
    async def handler(request: object) -> object:
        return None

    route = routes.Route("/v1/jobs/{key}", "GET", handler)  # type: ignore[arg-type]
    assert route.params("/v1/jobs/abc") == {"key": "abc"}
    assert route.params("/v1/jobs/") is None
    assert route.params("/v1/jobs/abc/more") is None
    assert route.params("/v1/job/abc") is None


def test_a_departure_calls_its_watchers_once() -> None:
    departure, calls = guard.Departure(), []
    departure.watch(lambda: calls.append("a"))
    departure.watch(dropped := lambda: calls.append("b"))
    departure.unwatch(dropped)
    departure.happened()
    departure.happened()
    assert calls == ["a"] and departure.gone


async def hello(scope: dict, receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"5")]})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"hello"})  # type: ignore[operator]


@pytest.mark.real_process
async def test_a_request_whose_connection_was_made_before_a_stop_is_answered() -> None:
    """A front door taken over at a reload stops while clients connect: one accepted
    just before, its request not yet sent, is answered (and closed), not dropped; one
    that never sends has a short grace, not the stop's whole 5 s."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = Server(uvicorn.Config(hello, http=guard.guarded(30.0, 16), lifespan="off",
                                   log_level="warning", timeout_graceful_shutdown=5))
    serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    reader, writer = await asyncio.open_connection(*sock.getsockname())
    _, silent = await asyncio.open_connection(*sock.getsockname())
    while len(server.server_state.connections) < 2:
        await asyncio.sleep(0.01)

    stopped_at = time.monotonic()
    server.should_exit = True
    while any(s.is_serving() for s in server.servers):  # accepting no more: stopping
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # past uvicorn's own pause after telling connections
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello"), answer
    assert b"connection: close" in answer.lower()
    await serving
    assert time.monotonic() - stopped_at < 4.0  # the silent one: the grace, not 5 s
    writer.close()
    silent.close()
