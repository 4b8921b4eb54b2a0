"""On a machine with CUDA: a model placed on the GPU serves and is charged VRAM, and its
workers map one copy of the weights from a holder over CUDA IPC.
Skipped elsewhere (tests marked `gpu`; see tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Daemon

pytestmark = pytest.mark.gpu


def test_generation_on_the_gpu_matches_the_cpu(make_daemon: Callable[..., Daemon],
                                               tiny_llm_dir: Path) -> None:
    daemon = make_daemon(f"""
        [[models]]
        key = "gpu-llm"
        capability = "text_to_text"
        path = "{tiny_llm_dir}"
        device = "cuda:0"
        [[models]]
        key = "cpu-llm"
        capability = "text_to_text"
        path = "{tiny_llm_dir}"
        device = "cpu"
    """)
    with daemon.client() as c:
        args = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        on_gpu = "".join(ch.text for ch in c.generate("Once", model="gpu-llm", **args))
        on_cpu = "".join(ch.text for ch in c.generate("Once", model="cpu-llm", **args))
        status = c.status()
    assert on_gpu == on_cpu
    model = next(m for m in status["models"] if m["key"] == "gpu-llm")
    assert model["device"] == "cuda:0" and model["memory_mb"] > 0
    assert status["memory"]["gpus"][0]["used_mb"] > 0


def test_gpu_workers_share_the_holders_weights_and_survive_its_death(
        make_daemon: Callable[..., Daemon], tiny_llm_dir: Path) -> None:
    daemon = make_daemon(f"""
        [pool]
        cold_start_workers = 2
        [[models]]
        key = "gpu-llm"
        capability = "text_to_text"
        path = "{tiny_llm_dir}"
        device = "cuda:0"
    """)
    args = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    def generate() -> str:
        with daemon.client() as c:
            return "".join(ch.text for ch in c.generate("Once", model="gpu-llm", **args))

    def processes() -> list[dict[str, object]]:
        with daemon.client() as c:
            return next(m for m in c.status()["models"] if m["key"] == "gpu-llm")["workers"]

    expected = generate()
    (holder,) = [p for p in processes() if p["holds_weights"]]
    assert len([p for p in processes() if not p["holds_weights"]]) == 2
    os.kill(int(holder["pid"]), signal.SIGKILL)  # its workers must not touch freed VRAM
    assert generate() == expected  # re-queued onto workers of a new holder
    deadline = time.monotonic() + 30
    while not any(p["holds_weights"] and p["pid"] != holder["pid"] for p in processes()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
