"""On a machine with CUDA: a model placed on the GPU serves and is charged VRAM.
Skipped elsewhere (tests marked `gpu`; see tests/conftest.py)."""

from __future__ import annotations

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
