"""Continuous batching through a real daemon: several streams on one generation worker,
joining and leaving between steps, each with its own ending.

The greedy-equality test runs the real tiny-llm (batched, against the same model served
one stream at a time); the timing-sensitive ones run `batched_counter`, a decoder that
steps every stream together every step_s without a model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Daemon, model_entry, start_daemon

from modelpool.protocol.client import AsyncClient, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor.server import usable_cpus

LLM = """
    [[models]]
    key = "{key}"
    capability = "text_to_text"
    path = "{path}"
    max_workers = 1
    max_active_sequences = {n}
"""


def _counter(key: str, step_s: float = 0.05, sequences: int = 8) -> str:
    return model_entry(key, loader="batched_counter", capability="text_to_text",
                       max_workers=1, step_s=step_s, max_sequences=sequences)


RECOMMENDED = {"temperature": 1.5, "top_k": 1, "repetition_penalty": 2.0}


def _recommending(tiny_llm_dir: Path, into: Path) -> Path:
    """tiny-llm's files, with a generation_config.json that recommends RECOMMENDED:
    greedy (top_k 1, whatever the temperature), with a repetition penalty."""
    into.mkdir()
    for made in tiny_llm_dir.iterdir():
        if made.name != "generation_config.json":
            (into / made.name).symlink_to(made)
    config = json.loads((tiny_llm_dir / "generation_config.json").read_text())
    (into / "generation_config.json").write_text(json.dumps({**config, **RECOMMENDED}))
    return into


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llm_dir: Path) -> Iterator[Daemon]:
    """One daemon for the module; each test has models of its own."""
    recommending = _recommending(tiny_llm_dir, tmp_path_factory.mktemp("rec") / "tiny-llm")
    config = ("[pool]\ncold_start_workers = 1\n"
              + LLM.format(key="batched", path=tiny_llm_dir, n=8)
              + LLM.format(key="single", path=tiny_llm_dir, n=1)
              + LLM.format(key="recommending", path=recommending, n=8)
              + LLM.format(key="affine", path=tiny_llm_dir, n=8).replace(
                  "max_workers = 1", "max_workers = 2")
              + _counter("join") + _counter("leave") + _counter("kill")
              + _counter("deadline") + _counter("slots", step_s=0.02, sequences=3))
    daemon = start_daemon(tmp_path_factory.mktemp("continuous"), config)
    try:
        yield daemon
    finally:
        daemon.stop()
        for child in daemon.descendants():
            child.kill()


async def _stream(c: AsyncClient, prompt: str, model: str, **kw: Any) -> tuple[str, str]:
    """(text, finish reason); a PoolError becomes ("", its code)."""
    pieces, reason = [], ""
    try:
        async for chunk in c.generate(prompt, model=model, **kw):
            pieces.append(chunk.text)
            reason = chunk.finish_reason or reason
    except PoolError as exc:
        return "".join(pieces), exc.code.value
    return "".join(pieces), reason


def _model(status: dict[str, Any], key: str) -> dict[str, Any]:
    return next(m for m in status["models"] if m["key"] == key)


async def _until(c: AsyncClient, key: str, test: Callable[[dict[str, Any]], bool],
                 timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        model = _model(await c.status(), key)
        if test(model):
            return model
        await asyncio.sleep(0.02)
    raise AssertionError(f"{key}: condition not met within {timeout_s}s: {model}")


def test_greedy_streams_batched_equal_one_at_a_time(daemon: Daemon) -> None:
    prompts = [f"Once upon a time {'there was ' * (i % 4)}number {i}" for i in range(8)]
    kw: dict[str, Any] = {"temperature": 0, "raw": True}

    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict[str, Any]]:
        async with AsyncClient(daemon.socket_path) as c:
            alone = [await _stream(c, p, "single", max_tokens=30 + 10 * i,
                                   ignore_eos=i % 2 == 0, **kw) for i, p in enumerate(prompts)]
            calls = [asyncio.ensure_future(_stream(c, p, "batched", max_tokens=30 + 10 * i,
                                                   ignore_eos=i % 2 == 0, **kw))
                     for i, p in enumerate(prompts)]
            busy = await _until(c, "batched", lambda m: m["running"] >= 2)
            together = await asyncio.gather(*calls)
            # Within a heartbeat the worker's generated tokens reach the status.
            after = await _until(c, "batched", lambda m: m["tokens"] > 0)
            return alone, together, {**busy, "after": after}

    alone, together, status = asyncio.run(run())
    assert together == alone
    assert {r for _, r in alone} <= {"length", "stop"} and all(t for t, _ in alone)
    (worker,) = status["workers"]
    assert worker["max_sequences"] == 8 and worker["sequences"] >= 2
    after = status["after"]
    assert after["tokens_per_s"] > 0 and after["workers"][0]["tokens_per_s"] > 0


def test_a_conversations_next_turn_goes_to_the_worker_that_holds_its_start(
        daemon: Daemon) -> None:
    """Two workers, each with its own prefix cache: the first turn runs on one, then a
    long stream starts there (both idle, the last used first); the next turn still goes
    to it, not to the idle one, and reuses what the first turn left."""
    system = {"role": "system", "content": "You are a tiny model in a pool. " * 4}
    turn = [system, {"role": "user", "content": "Tell me about rivers."}]
    kw: dict[str, Any] = {"model": "affine", "temperature": 0}

    async def run() -> tuple[Any, Any, tuple[str, str]]:
        async with AsyncClient(daemon.socket_path) as c:
            await c.load("affine", workers=2)
            await _until(c, "affine", lambda m: sum(w["state"] == "idle"
                                                    for w in m["workers"]) == 2, 60)
            first = [ch async for ch in c.generate(turn, max_tokens=8, **kw)]
            other = asyncio.ensure_future(_stream(c, "tiny model " * 4, raw=True,
                                                  max_tokens=1500, ignore_eos=True, **kw))
            await _until(c, "affine", lambda m: m["running"] == 1)
            answer = "".join(ch.text for ch in first)
            next_turn = [*turn, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "And then?"}]
            second = [ch async for ch in c.generate(next_turn, max_tokens=4, **kw)]
            busy = _model(await c.status(), "affine")["running"]
            assert busy == 1, "the long stream ended before the next turn was sent"
            return first[-1], second[-1], await other

    first, second, other = asyncio.run(run())
    assert other[1] == "length"
    assert second.cached_tokens >= first.prompt_tokens - 1 > 16


def test_what_a_models_generation_config_recommends_is_what_an_unset_request_gets(
        daemon: Daemon) -> None:
    kw: dict[str, Any] = {"max_tokens": 20, "raw": True, "ignore_eos": True}
    prompt = "Once upon a time"

    async def run() -> tuple[list[tuple[str, str]], dict[str, Any]]:
        async with AsyncClient(daemon.socket_path) as c:
            texts = [
                await _stream(c, prompt, "recommending", **kw),  # unseeded: greedy anyway
                await _stream(c, prompt, "recommending", **kw),
                await _stream(c, prompt, "single", temperature=0, repetition_penalty=2.0, **kw),
                await _stream(c, prompt, "single", temperature=0, **kw),
                await _stream(c, prompt, "recommending", top_k=0, temperature=0,
                              repetition_penalty=1.0, **kw)]  # what a request sets wins
            return texts, _model(await c.status(), "recommending")

    (unset, again, penalized, plain, overridden), status = asyncio.run(run())
    assert unset == again == penalized and penalized[0] != plain[0]
    assert overridden == plain
    assert status["recommended"] == RECOMMENDED


def test_a_stream_joins_while_others_are_mid_way(daemon: Daemon) -> None:

    async def run() -> tuple[list[tuple[str, str]], float, dict[str, Any]]:
        async with AsyncClient(daemon.socket_path) as c:
            first = [asyncio.ensure_future(_stream(c, f"p{i}", "join", max_tokens=40))
                     for i in range(4)]
            await _until(c, "join", lambda m: m["running"] == 4)
            await asyncio.sleep(0.5)  # about 10 of their 40 steps
            t0 = time.monotonic()
            late = await _stream(c, "late", "join", max_tokens=5)
            late_s = time.monotonic() - t0
            status = _model(await c.status(), "join")
            return [*await asyncio.gather(*first), late], late_s, status

    results, late_s, status = asyncio.run(run())
    expected = "".join(f"tok{i} " for i in range(40))
    assert results[:4] == [(expected, "length")] * 4
    assert results[4] == ("tok0 tok1 tok2 tok3 tok4 ", "length")
    assert late_s < 1.5  # it ran beside the others (5 steps), not after their 30 more
    assert len(status["workers"]) == 1  # all five on the one worker


def test_abort_and_stop_string_of_one_stream_leave_the_others(daemon: Daemon) -> None:

    async def aborted(c: AsyncClient) -> list[str]:
        got = []
        async for chunk in c.generate("abort me", model="leave", max_tokens=40):
            got.append(chunk.text)
            if len(got) == 3:
                break  # cancels the stream on the daemon
        return got

    async def run() -> list[Any]:
        async with AsyncClient(daemon.socket_path) as c:
            return await asyncio.gather(
                _stream(c, "a", "leave", max_tokens=20),
                _stream(c, "b", "leave", max_tokens=30, stop=["tok4 "]),
                aborted(c),
                _stream(c, "c", "leave", max_tokens=8),
                _stream(c, "d", "leave", max_tokens=25))

    a, b, cut, c8, d = asyncio.run(run())
    tokens = lambda n: "".join(f"tok{i} " for i in range(n))  # noqa: E731
    assert a == (tokens(20), "length")
    assert b == (tokens(4), "stop")
    assert "".join(cut) == tokens(3)
    assert c8 == (tokens(8), "length")  # mixed max_tokens: each ends at its own
    assert d == (tokens(25), "length")


def test_sigkilled_worker_with_8_streams_ends_each_exactly_once(daemon: Daemon) -> None:

    async def counted(c: AsyncClient, i: int) -> tuple[int, str]:
        chunks = 0
        try:
            async for chunk in c.generate(f"s{i}", model="kill", max_tokens=200):
                chunks += 1
                if chunk.finish_reason:
                    return chunks, chunk.finish_reason
        except PoolError as exc:
            return chunks, exc.code.value
        return chunks, "no ending"

    async def run() -> tuple[list[tuple[int, str]], str, dict[str, int]]:
        async with AsyncClient(daemon.socket_path) as c:
            calls = [asyncio.ensure_future(counted(c, i)) for i in range(8)]
            model = await _until(c, "kill", lambda m: m["running"] == 8)
            await asyncio.sleep(0.3)  # every stream has sent chunks
            os.kill(model["workers"][0]["pid"], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
            after = await _stream(c, "after", "kill", max_tokens=3)
            totals = _model(await c.status(), "kill")["totals"]
            endings = {o[2]: o[3] for o in totals["outcomes"] if o[0] == "generate"}
            return results, after[1], endings

    results, after, endings = asyncio.run(run())
    assert [reason for _, reason in results] == [ErrorCode.WORKER_DIED.value] * 8
    assert all(chunks > 0 for chunks, _ in results)
    assert after == "length"  # a replacement serves
    # The daemon's own count: one ending per request, none twice.
    assert endings == {ErrorCode.WORKER_DIED.value: 8, "OK": 1}


def test_deadlines_expire_mid_batch(daemon: Daemon) -> None:
    async def run() -> tuple[list[tuple[str, str]], dict[str, Any]]:
        async with AsyncClient(daemon.socket_path) as c:
            await _stream(c, "warm", "deadline", max_tokens=1)  # loaded: deadlines run
            results = await asyncio.gather(*(
                _stream(c, f"p{i}", "deadline", max_tokens=30,
                        **({"deadline_s": 0.6} if i % 2 else {})) for i in range(6)))
            model = await _until(c, "deadline", lambda m: m["running"] == 0
                                 and m["workers"][0]["state"] == "idle")
            return results, model

    results, model = asyncio.run(run())
    full = "".join(f"tok{i} " for i in range(30))
    for i, (text, reason) in enumerate(results):
        if i % 2:
            assert reason == ErrorCode.DEADLINE_EXPIRED.value
            assert full.startswith(text) and 0 < len(text) < len(full)
        else:
            assert (text, reason) == (full, "length")
    assert model["workers"][0]["sequences"] == 0  # the expired ones left the batch


def test_more_streams_than_slots_wait_their_turn(daemon: Daemon) -> None:
    async def run() -> tuple[list[tuple[str, str]], int]:
        async with AsyncClient(daemon.socket_path) as c:
            calls = [asyncio.ensure_future(_stream(c, f"p{i}", "slots", max_tokens=10))
                     for i in range(7)]
            most = 0
            while not all(call.done() for call in calls):
                model = _model(await c.status(), "slots")
                most = max(most, model["running"])
                await asyncio.sleep(0.01)
            return [call.result() for call in calls], most

    results, most = asyncio.run(run())
    assert results == [("".join(f"tok{i} " for i in range(10)), "length")] * 7
    assert most == 3  # never more than its slots on the one worker


def test_a_lone_stream_runs_on_the_cores_its_idle_siblings_leave(
        tmp_path: Path, tiny_llm_dir: Path) -> None:
    """Two cold-start workers share the cores; a stream alone gets them all."""
    cpus = usable_cpus()
    if cpus < 2:
        pytest.skip("one usable core: a worker's share is already every core")
    config = ("[pool]\ncold_start_workers = 2\nheartbeat_interval_s = 0.05\n"
              + LLM.format(key="alone", path=tiny_llm_dir, n=4))
    daemon = start_daemon(tmp_path, config)

    async def run() -> None:
        async with AsyncClient(daemon.socket_path) as c:
            await c.load("alone")
            await _until(c, "alone", lambda m: [w.get("threads") for w in m["workers"]]
                         == [cpus // 2])  # its share, as started
            stream = asyncio.create_task(
                _stream(c, "once", "alone", max_tokens=1900, ignore_eos=True))
            await _until(c, "alone", lambda m: [(w["inflight"], w.get("threads"))
                                                for w in m["workers"]] == [(1, cpus)])
            stream.cancel()

    try:
        asyncio.run(run())
    finally:
        daemon.stop()
