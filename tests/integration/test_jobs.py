"""The job API with a real daemon: jobs that outlive their connection and their client
process, results retrieved from anywhere by their owner only, every operation on the
tiny models, cancels, and a job whose worker is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    ROOT,
    Daemon,
    as_other_user,
    daemon_env,
    model_entry,
    other_user_env,
    start_daemon,
)

from modelpool.protocol.client import ImageChunk, TextResult
from modelpool.protocol.errors import ErrorCode, PoolError


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[Daemon]:
    models = "".join(f"""
        [[models]]
        key = "{name}"
        capability = "{capability}"
        path = "{tiny_models_dir / name}"
    """ for name, capability in (("tiny-llm", "text_to_text"), ("tiny-clip", "image_embedding"),
                                 ("tiny-vision", "vision"), ("tiny-sd", "text_to_image"),
                                 ("tiny-rerank", "rerank")))
    daemon = start_daemon(tmp_path_factory.mktemp("jobs"), f"""
        [daemon]
        socket_group = "postgres"
        [access]
        allow_groups = ["postgres"]
        [pool]
        cold_start_workers = 1
        {model_entry("slow", run_s=1.0)}
        {models}
    """)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_operation_as_a_job_returns_what_the_direct_call_does(daemon: Daemon) -> None:
    with daemon.client() as c:
        keys = {
            "embed": c.submit("embed", ["a", "b"]),
            "one": c.submit("embed", "a"),
            "generate": c.submit("generate", "Once", model="tiny-llm", max_tokens=4,
                                 temperature=0, ignore_eos=True),
            "embed_image": c.submit("embed_image", png(), model="tiny-clip"),
            "describe": c.submit("describe", png(), "what?", model="tiny-vision",
                                 max_tokens=3, temperature=0, ignore_eos=True),
            "generate_image": c.submit("generate_image", "a cat", model="tiny-sd", steps=2,
                                       width=64, height=64, seed=1),
            "rerank": c.submit("rerank", "q", ["x", "yy"], model="tiny-rerank"),
        }
    with daemon.client() as c:  # another connection
        results = {op: c.retrieve(key, timeout_s=60) for op, key in keys.items()}
        direct_text = "".join(ch.text for ch in c.generate(
            "Once", model="tiny-llm", max_tokens=4, temperature=0, ignore_eos=True))
        np.testing.assert_allclose(results["embed"], c.embed(["a", "b"]), atol=1e-6)
        np.testing.assert_allclose(results["rerank"], c.rerank("q", ["x", "yy"]), atol=1e-6)
    assert results["one"].shape == (384,) and results["embed_image"].shape == (32,)
    generated = results["generate"]
    assert isinstance(generated, TextResult) and generated.text == direct_text
    assert generated.completion_tokens == 4 and generated.finish_reason == "length"
    assert isinstance(results["describe"], TextResult) and results["describe"].text
    image = results["generate_image"]
    assert isinstance(image, ImageChunk) and image.png and image.png[:4] == b"\x89PNG"


def test_a_job_outlives_its_connection_and_its_client_process(daemon: Daemon) -> None:
    submitter = f"""
import os, signal, sys
from modelpool.protocol.client import Client
with Client(socket_path={daemon.socket_path!r}) as c:
    print(c.submit("embed", ["abcd", "ef"], model="slow"), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    run = subprocess.run([sys.executable, "-c", submitter], capture_output=True, text=True,
                         timeout=60, env=daemon_env(daemon.socket_path), cwd=ROOT)
    assert run.returncode == -signal.SIGKILL
    key = run.stdout.strip()
    with daemon.client() as c:
        assert c.job(key)["state"] in ("queued", "running")
        result = c.retrieve(key, timeout_s=30)
        assert result[:, 0].tolist() == [4.0, 2.0]
        assert c.job(key)["state"] == "done" and key in [j["key"] for j in c.jobs()]


def test_retrieve_times_out_then_gets_the_result(daemon: Daemon) -> None:
    with daemon.client() as c:
        key = c.submit("embed", "slowly", model="slow")
        with pytest.raises(PoolError) as err:
            c.retrieve(key, timeout_s=0.2)
        assert err.value.code is ErrorCode.TIMEOUT
        assert c.retrieve(key, timeout_s=30)[0] == 6.0


def test_cancel_a_running_and_a_queued_job(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.embed("warm", model="slow")
        running = c.submit("embed", "first", model="slow")
        queued = c.submit("embed", "second", model="slow")  # one worker: this one waits
        time.sleep(0.2)
        assert c.job(queued)["state"] == "queued"
        for key in (queued, running):
            c.cancel(key)
            with pytest.raises(PoolError) as err:
                c.retrieve(key, timeout_s=10)
            assert err.value.code is ErrorCode.CANCELLED
            assert c.job(key)["state"] == "cancelled"
        c.forget(running)
        with pytest.raises(PoolError) as err:
            c.job(running)
        assert err.value.code is ErrorCode.RESULT_NOT_FOUND


def test_a_job_whose_worker_is_killed_gets_exactly_one_result(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.embed("warm", model="slow")
        failed = c.stats()["failed"]
        key = c.submit("embed", "victim", model="slow")
        time.sleep(0.3)  # it runs
        (pid,) = [w["pid"] for m in c.status()["models"] if m["key"] == "slow"
                  for w in m["workers"] if w["state"] == "busy"]
        os.kill(pid, signal.SIGKILL)
        assert c.retrieve(key, timeout_s=30)[0] == 6.0
        assert c.stats()["failed"] == failed


def test_another_user_cannot_retrieve_a_job(daemon: Daemon) -> None:
    with daemon.client() as c:
        key = c.submit("embed", "mine")
        c.retrieve(key, timeout_s=30)
    other = f"""
import json
from modelpool.protocol.client import Client, PoolError
with Client(socket_path={daemon.socket_path!r}) as c:
    try:
        c.retrieve({key!r}, timeout_s=1)
        print(json.dumps("ok"))
    except PoolError as exc:
        print(json.dumps(exc.code.value))
"""
    run = subprocess.run(as_other_user([sys.executable, "-c", other]), capture_output=True,
                         text=True, timeout=60, env=other_user_env(), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == "RESULT_NOT_FOUND"


def test_the_cli_submits_lists_and_prints_results(daemon: Daemon) -> None:
    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "--socket",
                              daemon.socket_path, *args], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env=daemon_env(daemon.socket_path))
        assert out.returncode == 0, out.stderr
        return out.stdout

    key = cli("submit", "rerank", "q", "x", "yy", "--model", "tiny-rerank").strip()
    scores = [json.loads(line) for line in cli("result", key).splitlines()]
    assert len(scores) == 2
    assert key in cli("jobs")
    assert json.loads(cli("stats", "--json"))["completed"] >= 1
