"""A stream a node relays to another through the shared queue reaches its client as it is
made: the pieces through PostgreSQL on the client's node's channel, whole and in order;
through two real daemons, a client of one streams a model only the other runs, and its
cancel stops the generation there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest
from cluster_helpers import (
    Daemon,
    Database,
    free_http,
    model_entry,
    model_status,
    node_config,
    nodes_seeing_each_other,
    start_node,
    wait_until,
)
from pgjobs_helpers import node, record, submit

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.pgstreams import StreamPiece


async def test_a_streams_pieces_reach_the_node_it_was_asked_of_whole_and_in_order(
        database: Database) -> None:
    async with node(database, "runs") as runs, node(database, "asks") as asks:
        channel = asks.streams.channel
        asked = await submit(asks, msgspec.structs.replace(record(), stream_to=channel))
        pieces = asks.streams.followers.follow(asked.key)
        [claimed] = await runs.claim({"m": 1})
        assert (claimed.key, claimed.stream_to, claimed.attempt) == (asked.key, channel, 1)
        texts = [f"tok{i} " for i in range(300)] + ["é" * 20_000]  # ~40 KB in one piece
        offset = 0
        for text in texts:
            runs.streams.publisher.publish(claimed.stream_to, StreamPiece(
                claimed.key, claimed.attempt, offset, text))
            offset += len(text)
        got = ""
        while len(got) < offset:
            piece = await asyncio.wait_for(pieces.get(), 10)
            assert (piece.key, piece.attempt, piece.offset) == (asked.key, 1, len(got))
            got += piece.text
        assert got == "".join(texts)
        assert pieces.empty()
        assert runs.streams.followers.follow("other").empty()  # only the asking node's


GENERATOR = model_entry("gen", loader="counting_generator", capability="text_to_text",
                        step_s=0.1) + model_entry("thinker", loader="counting_generator",
                                                  capability="text_to_text", step_s=0.01,
                                                  think_tokens=2) + model_entry(
    "caller", loader="calling_generator", capability="text_to_text", step_s=0.1)


def http_on(url: str) -> str:
    return f'\n[http]\nlisten = "{url.removeprefix("http://")}"\n'


@pytest.fixture
def alpha_http() -> str:
    return free_http()


@pytest.fixture
def two_nodes(tmp_path: Path, database: Database, beta_http: str,
              alpha_http: str) -> Iterator[tuple[Daemon, Daemon]]:
    """alpha runs gen; beta's config does not name it, so beta relays it to alpha. Both
    serve the HTTP API (open: loopback only)."""
    http = http_on(beta_http)
    with nodes_seeing_each_other(
            lambda: start_node(tmp_path / "alpha", node_config(database.dsn, "alpha",
                                                               GENERATOR)
                               + http_on(alpha_http)),
            lambda: start_node(tmp_path / "beta", node_config(database.dsn, "beta", "")
                               + http),
    ) as (alpha, beta):
        yield alpha, beta


def generating(alpha: Daemon) -> bool:
    with alpha.client() as a:
        return any(w["state"] != "idle" for w in model_status(a.status(), "gen")["workers"])


def test_a_client_of_one_node_streams_a_model_another_node_runs_as_it_is_made(
        two_nodes: tuple[Daemon, Daemon]) -> None:
    _, beta = two_nodes
    with beta.client() as c:
        wait_until(lambda: any(m["key"] == "gen" for m in c.models()), 20, "beta knows gen")
        got, arrived = [], []
        for part in c.generate("hello", model="gen", max_tokens=12):
            got.append(part)
            arrived.append(time.monotonic())
    assert (got[-1].finish_reason, got[-1].completion_tokens) == ("length", 12)
    assert "".join(part.text for part in got) == "".join(f"tok{i} " for i in range(12))
    # As made, a token each 0.1 s: not one chunk at the end (as before), and the first
    # long before the last.
    assert len([part for part in got if part.text]) >= 4
    assert arrived[-1] - arrived[0] > 0.5
    # Each token's log-probabilities stream beside its text, as made.
    with beta.client() as c:
        scored = list(c.generate("hello", model="gen", max_tokens=3, logprobs=0))
    assert "".join(part.text for part in scored) == "tok0 tok1 tok2 "
    assert [(e.token, e.logprob) for part in scored for e in part.logprobs or []] == [
        ("tok0 ", 0.0), ("tok1 ", -1.0), ("tok2 ", -2.0)]
    assert len([part for part in scored if part.logprobs]) >= 2  # not whole at the end
    # A reasoning model's thinking streams as it is made, before its answer.
    with beta.client() as c:
        wait_until(lambda: any(m["key"] == "thinker" for m in c.models()), 20, "thinker")
        thought = list(c.generate("hello", model="thinker", max_tokens=6))
    assert "".join(part.reasoning for part in thought) == "tok0 tok1"
    assert "".join(part.text for part in thought) == "tok2 tok3 tok4 tok5 "
    kinds = [("thinking" if part.reasoning else "") + ("answer" if part.text else "")
             for part in thought]
    assert kinds.count("thinking") >= 1 and kinds.index("thinking") < kinds.index("answer")
    assert thought[-1].reasoning_tokens == 3  # "<think>tok0 ", "tok1 ", "</think>tok2 "
    # A tokenize is relayed as any request is: alpha's worker answers it (its loader has
    # no tokenizer, which it says by name)
    with beta.client() as c, pytest.raises(PoolError, match="gives no tokenizer") as refused:
        c.tokenize("hello", model="gen")
    assert refused.value.code is ErrorCode.BAD_REQUEST


def test_a_relayed_streams_tool_calls_arrive_as_they_are_written(
        two_nodes: tuple[Daemon, Daemon]) -> None:
    """Each call's head, then its arguments piece by piece, relayed as the other node's
    worker writes them; joined, the last chunk's calls."""
    _, beta = two_nodes
    tools = [{"type": "function", "function": {"name": "count"}}]
    with beta.client() as c:
        wait_until(lambda: any(m["key"] == "caller" for m in c.models()), 20, "caller")
        got, arrived = [], []
        for part in c.generate("hello", model="caller", tools=tools, tool_choice="auto",
                               max_tokens=20):
            got.append(part)
            arrived.append(time.monotonic())
    assert got[-1].finish_reason == "tool_calls" and "".join(p.text for p in got) == "tok0 "
    (call,) = got[-1].tool_calls or []
    assert (call.name, msgspec.json.decode(call.arguments)) == (
        "count", {f"n{i}": i for i in range(4)})
    pieces = [(at, d) for part, at in zip(got, arrived, strict=True) for d in part.calls or ()]
    assert (pieces[0][1].name, pieces[0][1].id) == (call.name, call.id)
    assert "".join(d.arguments for _, d in pieces) == call.arguments
    assert len(pieces) >= 4 and pieces[-1][0] - pieces[0][0] > 0.2  # as made, 0.1 s apart


def test_a_cancelled_relayed_stream_stops_on_the_node_that_runs_it(
        two_nodes: tuple[Daemon, Daemon]) -> None:
    alpha, beta = two_nodes
    with beta.client() as c:
        wait_until(lambda: any(m["key"] == "gen" for m in c.models()), 20, "beta knows gen")
        stream = c.generate("hello", model="gen", max_tokens=600)  # a minute of tokens
        first = next(stream)
        stream.close()  # sends the request's Cancel; the connection stays open
        started = time.monotonic()
        wait_until(lambda: not generating(alpha), 20, "alpha's generation stopped")
        stopped_in = time.monotonic() - started
        assert c.embed("the connection still serves", model="all-MiniLM-L6-v2") is not None
    assert first.text == "tok0 "
    assert stopped_in < 20  # not the minute the whole stream takes


def test_an_openai_client_of_one_node_streams_another_nodes_model_and_can_leave(
        two_nodes: tuple[Daemon, Daemon], beta_http: str) -> None:
    alpha, _ = two_nodes
    sdk = openai.OpenAI(base_url=f"{beta_http}/v1", api_key="unused", max_retries=0,
                        timeout=60)
    wait_until(lambda: "gen" in {m.id for m in sdk.models.list()}, 30, "beta lists gen")
    texts = [part.choices[0].text for part in sdk.completions.create(
        model="gen", prompt="count", max_tokens=8, stream=True)]
    assert "".join(texts) == "".join(f"tok{i} " for i in range(8))
    assert len([text for text in texts if text]) >= 4  # as made, not at the end
    with sdk.completions.create(model="gen", prompt="count", max_tokens=600,
                                stream=True) as endless:
        assert next(iter(endless)).choices[0].text == "tok0 "
    # The HTTP client left: beta's front door cancels its request, so alpha stops.
    wait_until(lambda: not generating(alpha), 20, "alpha's generation stopped")


def _followed(node: Daemon, key: str) -> tuple[list[str], list[float]]:
    got, arrived = [], []
    with node.client() as c:
        for part in c.follow(key):
            got.append(part.text)
            arrived.append(time.monotonic())
    return got, arrived


def test_a_streamed_job_is_followed_live_through_either_node(
        two_nodes: tuple[Daemon, Daemon]) -> None:
    """beta keeps the stream of a job alpha runs (its pieces come to beta's channel);
    alpha, which keeps none of it, asks beta for them: the same chunks, live too."""
    alpha, beta = two_nodes
    with beta.client() as c:
        wait_until(lambda: any(m["key"] == "gen" for m in c.models()), 20, "beta knows gen")
        key = c.submit("generate", "hello", model="gen", max_tokens=8, stream=True)
    got, arrived = _followed(beta, key)
    assert "".join(got) == "".join(f"tok{i} " for i in range(8))
    assert len([text for text in got if text]) >= 4 and arrived[-1] - arrived[0] > 0.3
    assert _followed(beta, key)[0] == got == _followed(alpha, key)[0]  # once it has ended
    with beta.client() as c:
        key = c.submit("generate", "hello", model="gen", max_tokens=8, stream=True)
    through_alpha, arrived = _followed(alpha, key)  # while it runs
    assert through_alpha == _followed(beta, key)[0]
    assert len([text for text in through_alpha if text]) >= 4
    assert arrived[-1] - arrived[0] > 0.3  # as made, 0.1 s apart


def test_a_background_response_streams_through_a_node_that_does_not_run_it(
        two_nodes: tuple[Daemon, Daemon], beta_http: str, alpha_http: str) -> None:
    """The OpenAI SDK asks beta's HTTP API for a streamed background response of a model
    only alpha runs: its deltas come as alpha makes them, and beta streams it again after
    an event the client had."""
    sdk = openai.OpenAI(base_url=f"{beta_http}/v1", api_key="unused", max_retries=0,
                        timeout=60)
    wait_until(lambda: "gen" in {m.id for m in sdk.models.list()}, 30, "beta lists gen")
    events, arrived = [], []
    for event in sdk.responses.create(model="gen", input="x", max_output_tokens=8,
                                      background=True, stream=True):
        events.append(event)
        arrived.append(time.monotonic())
    deltas = [(at, e.delta) for at, e in zip(arrived, events, strict=True)
              if e.type == "response.output_text.delta"]
    assert "".join(d for _, d in deltas) == "".join(f"tok{i} " for i in range(8))
    assert len(deltas) >= 4 and deltas[-1][0] - deltas[0][0] > 0.3  # as made, 0.1 s apart
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    again = list(sdk.responses.retrieve(events[0].response.id, stream=True, starting_after=2))
    assert [(e.type, e.sequence_number) for e in again] == [
        (e.type, e.sequence_number) for e in events[3:]]
    # and through alpha's front door, which keeps none of it: the same events
    through_alpha = openai.OpenAI(base_url=f"{alpha_http}/v1", api_key="unused",
                                  max_retries=0, timeout=60)
    again = list(through_alpha.responses.retrieve(events[0].response.id, stream=True,
                                                  starting_after=2))
    assert [(e.type, e.sequence_number, getattr(e, "delta", None)) for e in again] == [
        (e.type, e.sequence_number, getattr(e, "delta", None)) for e in events[3:]]


def test_a_follow_through_another_node_ends_whole_when_its_keeper_dies(
        tmp_path: Path, database: Database) -> None:
    """beta keeps the stream of a job alpha runs; a client of alpha follows it (from
    beta's pieces) and beta is killed on the way: the rest comes with the end, from the
    job's result, which alpha makes."""
    alpha = start_node(tmp_path / "alpha", node_config(database.dsn, "alpha", GENERATOR))
    beta = start_node(tmp_path / "beta", node_config(database.dsn, "beta", ""))
    try:
        with beta.client() as c:
            wait_until(lambda: any(m["key"] == "gen" for m in c.models()), 30, "beta knows gen")
            key = c.submit("generate", "hello", model="gen", max_tokens=30, stream=True)
        got = []
        with alpha.client() as a:
            for part in a.follow(key):
                got.append(part)
                if len([p for p in got if p.text]) == 3:
                    for child in beta.descendants():
                        child.kill()
                    beta.process.kill()
        assert "".join(p.text for p in got) == "".join(f"tok{i} " for i in range(30))
        assert got[-1].finish_reason == "length"
        assert len([p for p in got if p.text]) == 4  # three as made, then the rest whole
    finally:
        assert alpha.stop() == 0, alpha.log()
        beta.process.kill()
