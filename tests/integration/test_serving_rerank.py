"""Rerank through a real daemon: a cross-encoder (tiny-rerank, its ONNX export cached)
loaded by a worker, its scores equal to the same model run in this process by
sentence-transformers, from the client and the CLI."""

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

from modelpool.protocol.client import AsyncClient
from modelpool.protocol.errors import ErrorCode, PoolError

QUERY = "what does a worker do"
DOCS = ["a worker keeps one model loaded and runs it", "the queue holds requests",
        "image bytes travel in shared memory", "x"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[Daemon]:
    daemon = start_daemon(tmp_path_factory.mktemp("rerank"), f"""
        [pool]
        max_batch = 3
        [[models]]
        key = "tiny-rerank"
        capability = "rerank"
        path = "{tiny_models_dir / 'tiny-rerank'}"
    """)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def _in_process(tiny_models_dir: Path, query: str, docs: list[str]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(tiny_models_dir / "tiny-rerank"))
    return model.predict([(query, d) for d in docs])


def test_scores_equal_the_model_run_in_process(daemon: Daemon, tiny_models_dir: Path) -> None:
    with daemon.client() as c:
        scores = c.rerank(QUERY, DOCS)  # the only rerank model: the default one
        named = c.rerank(QUERY, DOCS[:1], model="tiny-rerank")
    assert scores.dtype == np.float32 and scores.shape == (len(DOCS),)
    np.testing.assert_allclose(scores, _in_process(tiny_models_dir, QUERY, DOCS),
                               rtol=1e-5, atol=1e-6)
    assert named.shape == (1,) and named[0] == pytest.approx(scores[0], abs=1e-6)


def test_its_worker_runs_the_cached_onnx_export(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.rerank(QUERY, DOCS)
        deadline = time.monotonic() + 60
        while True:  # a second worker may still be loading: its info comes once loaded
            (model,) = [m for m in c.status()["models"] if m["key"] == "tiny-rerank"]
            infos = [w["info"] for w in model["workers"]]
            if all(infos) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert infos and all(i["execution"] == "onnx" for i in infos), infos
    assert all(i["execution_reason"].endswith(", fused") for i in infos)


def test_more_documents_than_max_batch_are_split_and_come_back_in_order(
        daemon: Daemon, tiny_models_dir: Path) -> None:
    docs = [f"document number {i} about workers and queues" for i in range(10)]
    with daemon.client() as c:
        scores = c.rerank(QUERY, docs)  # parts of 3, 3, 3 and 1 pairs
    np.testing.assert_allclose(scores, _in_process(tiny_models_dir, QUERY, docs),
                               rtol=1e-5, atol=1e-6)


def test_concurrent_queries_each_get_their_own_scores(daemon: Daemon) -> None:
    async def run() -> list[np.ndarray]:
        async with AsyncClient(daemon.socket_path) as c:
            return await asyncio.gather(*(c.rerank(f"query {i}", DOCS) for i in range(8)))

    results = asyncio.run(run())
    with daemon.client() as c:
        for i, scores in enumerate(results):
            np.testing.assert_allclose(scores, c.rerank(f"query {i}", DOCS), atol=1e-6)


def test_a_rerank_model_does_not_embed(daemon: Daemon) -> None:
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed("hello", model="tiny-rerank")
    assert err.value.code is ErrorCode.WRONG_CAPABILITY


def test_the_cli_prints_one_score_per_document(daemon: Daemon) -> None:
    out = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "--socket",
                          daemon.socket_path, "rerank", QUERY, *DOCS[:2]],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    printed = [json.loads(line) for line in out.stdout.splitlines()]
    with daemon.client() as c:
        assert printed == pytest.approx(c.rerank(QUERY, DOCS[:2]).tolist(), abs=1e-6)
