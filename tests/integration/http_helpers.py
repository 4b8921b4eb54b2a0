"""A real daemon serving the HTTP API on a loopback port, for the HTTP tests."""

from __future__ import annotations

import base64
import contextlib
import io
import select
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
                http: str = "", images: bool = False) -> tuple[Daemon, str]:
    """A daemon with every capability on tiny models (MiniLM for text embeddings) and
    the HTTP API on a free loopback port; returns it and the API's base URL. Its callers'
    fixtures ask for tiny_rerank_export, so that tiny-rerank starts on its export.
    Text-to-image (tiny-sd) only with images: diffusers, which its forkserver would
    import before any first worker, took 1.5-3 s of each daemon's start here."""
    port = free_port()
    if images:
        extra = f"""
        [[models]]
        key = "tiny-sd"
        capability = "text_to_image"
        path = "{tiny_models_dir / 'tiny-sd'}"
        {extra}"""
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
        # A short context: the schema's fuzzing asks for up to 2**20 tokens, and with the
        # model's own 2,048 one request took up to 6 s (a minute of test_http_schema's
        # fuzzing ran 1,207 requests with 64, 205-837 with 2,048)
        options = {{ context = 64 }}
        [[models]]
        key = "tiny-clip"
        capability = "image_embedding"
        path = "{tiny_models_dir / 'tiny-clip'}"
        [[models]]
        key = "tiny-vision"
        capability = "vision"
        path = "{tiny_models_dir / 'tiny-vision'}"
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
    try:
        wait_for_http(base, daemon)
    except BaseException:  # no fixture will stop it: it would outlive the test run
        daemon.stop()
        raise
    return daemon, base


def long_llm(tiny_models_dir: Path) -> str:
    """tiny-llm again as "tiny-llm-long", with room for tools in its prompt (the shared
    entry's context is 64)."""
    return f"""
        [[models]]
        key = "tiny-llm-long"
        capability = "text_to_text"
        path = "{tiny_models_dir / 'tiny-llm'}"
        options = {{ context = 1024 }}
        """


def png(color: tuple[int, int, int], size: int = 32) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def running(client: object, model: str) -> int:
    status = client.status()  # type: ignore[attr-defined]
    return next(m["running"] + m["queued"] for m in status["models"] if m["key"] == model)


def wait_running(daemon: Daemon, model: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    with daemon.client() as c:
        while running(c, model) == 0:
            assert time.monotonic() < deadline, f"{model} ran nothing within {timeout_s}s"
            time.sleep(0.02)


def wait_idle(daemon: Daemon, model: str, timeout_s: float = 10) -> float:
    """Seconds until the model runs and queues nothing; still busy after timeout_s fails."""
    start = time.monotonic()
    with daemon.client() as c:
        while running(c, model) and time.monotonic() - start < timeout_s:
            time.sleep(0.05)
        assert running(c, model) == 0, "the request went on after its client left"
    return time.monotonic() - start


# ---- raw connections, for clients too slow or too many for a real HTTP client ----------


def raw_connection(base: str) -> socket.socket:
    host, _, port = base.removeprefix("http://").rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def read_to_close(sock: socket.socket, timeout_s: float = 3.0) -> bytes:
    """All the server sends until it closes; a socket still open after timeout_s fails."""
    sock.settimeout(timeout_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def trickle(socks: list[socket.socket], data: bytes, interval_s: float,
            limit_s: float) -> list[tuple[float, bytes]]:
    """Sends data to every socket a byte per interval_s until the server answers or
    closes; for each, (seconds until then, all it answered). No end within limit_s fails."""
    start = time.monotonic()
    ended: dict[socket.socket, tuple[float, bytes]] = {}
    sent = 0
    while len(ended) < len(socks):
        elapsed = time.monotonic() - start
        assert elapsed < limit_s, f"{len(socks) - len(ended)} connection(s) still open"
        waiting = [s for s in socks if s not in ended]
        readable, _, _ = select.select(waiting, [], [], interval_s)
        for sock in readable:
            ended[sock] = (time.monotonic() - start, read_to_close(sock))
        if sent < len(data):
            for sock in waiting:
                if sock not in ended:
                    with contextlib.suppress(OSError):  # closed under it: read next round
                        sock.send(data[sent:sent + 1])
            sent += 1
    return [ended[s] for s in socks]


def status_of(answer: bytes) -> int | None:
    """The status of a raw HTTP answer; None for a connection closed without one."""
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
