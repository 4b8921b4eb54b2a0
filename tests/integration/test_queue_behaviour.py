"""Admission and queueing with real processes: priorities, bounds under flood, deadlines,
dedup and dynamic batching."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from conftest import MakeDaemon

from modelpool.protocol.client import AsyncClient, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import frame, recv_frame, send_frame
from modelpool.protocol.messages import Embed, Error, Hello, encoder
from modelpool.protocol.wire import server_decoder


def counted(key: str, log: Path, run_s: float, extra: str = "") -> str:
    return f"""
        [[models]]
        key = "{key}"
        capability = "text_embedding"
        loader = "mp_test_loaders:slow_embedder"
        options = {{ run_s = {run_s}, log = "{log}" }}
        max_workers = 1
        {extra}
    """


def ran(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_mixed_priorities_complete_in_priority_order(make_daemon: MakeDaemon,
                                                     tmp_path: Path) -> None:
    log = tmp_path / "ran.txt"
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n"
                         + counted("m", log, 0.3, "max_batch = 1"))

    async def run() -> None:
        async with AsyncClient(daemon.socket_path) as c:
            await c.embed("warm", model="m")
            first = asyncio.ensure_future(c.embed("busy", model="m"))
            await asyncio.sleep(0.1)  # the only worker is now busy
            calls = [asyncio.ensure_future(c.embed(p, model="m", priority=p))
                     for p in ("batch", "low", "normal", "high", "critical")]
            await asyncio.gather(first, *calls)

    asyncio.run(run())
    assert ran(log)[2:] == ["critical", "high", "normal", "low", "batch"]


def test_expired_request_never_reaches_a_worker(make_daemon: MakeDaemon,
                                                tmp_path: Path) -> None:
    log = tmp_path / "ran.txt"
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n" + counted("m", log, 0.5))

    async def run() -> PoolError:
        async with AsyncClient(daemon.socket_path) as c:
            await c.embed("warm", model="m")
            busy = asyncio.ensure_future(c.embed("busy", model="m"))
            await asyncio.sleep(0.1)
            try:
                await c.embed("too late", model="m", deadline_s=0.2)
            except PoolError as exc:
                await busy
                return exc
            raise AssertionError("the expired request was answered")

    error = asyncio.run(run())
    assert error.code is ErrorCode.DEADLINE_EXPIRED
    time.sleep(0.3)
    assert "too late" not in ran(log)


def test_identical_concurrent_requests_run_once(make_daemon: MakeDaemon,
                                                tmp_path: Path) -> None:
    log = tmp_path / "ran.txt"
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n" + counted("m", log, 0.3))

    async def run() -> list[np.ndarray]:
        async with AsyncClient(daemon.socket_path) as c:
            await c.embed("warm", model="m")
            return await asyncio.gather(*(c.embed("same", model="m") for _ in range(20)))

    results = asyncio.run(run())
    assert all(r[0] == 4.0 for r in results) and len(results) == 20
    assert ran(log).count("same") == 1
    with daemon.client() as c:
        model = next(m for m in c.status()["models"] if m["key"] == "m")
    assert sum(p["deduplicated"] for p in model["priorities"]) == 19


def test_concurrent_single_embeds_are_batched(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("")
    texts = [f"text number {i}" for i in range(64)]

    async def run() -> list[np.ndarray]:
        async with AsyncClient(daemon.socket_path) as c:
            await c.embed("warm up")
            return await asyncio.gather(*(c.embed(t) for t in texts))

    got = np.stack(asyncio.run(run()))
    with daemon.client() as c:
        expected = c.embed(texts)  # one request of all 64: the reference rows
        minilm = next(m for m in c.status()["models"]
                      if m["key"] == "sentence-transformers/all-MiniLM-L6-v2")
    assert np.allclose(got, expected, atol=1e-5)  # each caller got its own row
    batched = minilm["mean_batch"]
    assert batched > 8, batched


def test_requests_sent_in_one_write_go_to_a_free_worker_as_one_batch(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n"
                         + counted("m", tmp_path / "ran.txt", 0.0))
    with daemon.client() as c:
        c.embed("warm", model="m")  # a batch of one; the worker is free again
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(daemon.socket_path)
        send_frame(sock, encoder.encode(Hello(protocol_version=1)))
        recv_frame(sock)
        sock.sendall(b"".join(frame(encoder.encode(Embed(id=i, model="m", texts=[f"t{i}"])))
                              for i in range(8)))
        replies = [server_decoder.decode(recv_frame(sock)) for _ in range(8)]
    assert sorted(r.id for r in replies) == list(range(8))
    assert not any(isinstance(r, Error) for r in replies)
    with daemon.client() as c:
        (model,) = [m for m in c.status()["models"] if m["key"] == "m"]
    # Two batches, of 1 and 8: not the first of the eight alone and the seven after it.
    assert model["mean_batch"] == 4.5, model["totals"]["batch_size"]


def _flood(sock_path: str, count: int) -> tuple[int, int, list[float]]:
    """Send count requests as fast as possible; returns (ok, rejected, reject latencies)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)
    send_frame(sock, encoder.encode(Hello(protocol_version=1)))
    recv_frame(sock)
    sent_at: dict[int, float] = {}
    counts = {"ok": 0, "rejected": 0}
    latencies: list[float] = []

    def read() -> None:
        for _ in range(count):
            msg = server_decoder.decode(recv_frame(sock))
            if isinstance(msg, Error) and msg.code is ErrorCode.QUEUE_FULL:
                counts["rejected"] += 1
                latencies.append(time.perf_counter() - sent_at.pop(msg.id))
            else:
                counts["ok"] += 1

    reader = threading.Thread(target=read)
    reader.start()
    batch = 2000
    for start in range(0, count, batch):
        frames = []
        for i in range(start, min(count, start + batch)):
            sent_at[i] = time.perf_counter()
            frames.append(frame(encoder.encode(Embed(id=i, model="m", texts=[str(i)]))))
        sock.sendall(b"".join(frames))
    reader.join(600)
    sock.close()
    return counts["ok"], counts["rejected"], latencies


def test_a_flood_is_rejected_fast_and_memory_stays_bounded(make_daemon: MakeDaemon,
                                                           tmp_path: Path) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 1\n"
                         + counted("m", tmp_path / "ran.txt", 0.2, "max_queue = 100"))
    with daemon.client() as c:
        c.embed("warm", model="m")
    supervisor = psutil.Process(daemon.process.pid)
    rss_before = supervisor.memory_info().rss
    started = time.monotonic()
    ok, rejected, latencies = _flood(daemon.socket_path, 300_000)
    # All but the bound: the queue (100) and what one worker of batches of 32 every
    # 0.2 s served while the flood lasted (longer on a busy machine).
    served = 100 + 32 * ((time.monotonic() - started) / 0.2 + 1)
    assert ok + rejected == 300_000 and ok <= served, (ok, served)
    assert supervisor.memory_info().rss - rss_before < 200 * 2**20
    assert np.percentile(latencies, 50) < 5.0  # includes time queued in our own socket
    with daemon.client() as c:  # still serving
        assert c.embed("after", model="m")[0] == 5.0
