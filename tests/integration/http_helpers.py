"""A real daemon serving the HTTP API on a loopback port, for the HTTP tests."""

from __future__ import annotations

import base64
import io
import socket
import time
from pathlib import Path

import httpx2 as httpx
from conftest import Daemon, start_daemon
from PIL import Image

KEY = "test-key-0123456789"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_http(base: str, daemon: Daemon, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"daemon exited:\n{daemon.log()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"HTTP API did not answer within {timeout_s}s:\n{daemon.log()}")


def http_daemon(workdir: Path, tiny_models_dir: Path, extra: str = "",
                http: str = "") -> tuple[Daemon, str]:
    """A daemon with every capability on tiny models (MiniLM for text embeddings) and
    the HTTP API on a free loopback port; returns it and the API's base URL."""
    port = free_port()
    daemon = start_daemon(workdir, f"""
        [pool]
        timeout_s = 60
        [http]
        listen = "127.0.0.1:{port}"
        api_keys = ["{KEY}"]
        {http}
        [[models]]
        key = "tiny-llm"
        capability = "text_to_text"
        path = "{tiny_models_dir / 'tiny-llm'}"
        default = true
        [[models]]
        key = "tiny-clip"
        capability = "image_embedding"
        path = "{tiny_models_dir / 'tiny-clip'}"
        [[models]]
        key = "tiny-vision"
        capability = "vision"
        path = "{tiny_models_dir / 'tiny-vision'}"
        [[models]]
        key = "tiny-sd"
        capability = "text_to_image"
        path = "{tiny_models_dir / 'tiny-sd'}"
        [[models]]
        key = "tiny-rerank"
        capability = "rerank"
        path = "{tiny_models_dir / 'tiny-rerank'}"
        [[models]]
        key = "counter"
        capability = "text_to_text"
        loader = "mp_test_loaders:counting_generator"
        options = {{ step_s = 0.05 }}
        max_workers = 1
        max_queue = 1
        [[models]]
        key = "slow-embed"
        capability = "text_embedding"
        loader = "mp_test_loaders:slow_embedder"
        options = {{ run_s = 3 }}
        max_workers = 1
        {extra}
    """)
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)
    return daemon, base


def png(color: tuple[int, int, int], size: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def running(client: object, model: str) -> int:
    status = client.status()  # type: ignore[attr-defined]
    return next(m["running"] + m["queued"] for m in status["models"] if m["key"] == model)
