"""The HTTP front door against the socket, on the same daemon in the same run; and the
front door in a process of its own against the supervisor's loop ([http] in_loop).

The HTTP client is a minimal keep-alive HTTP/1.1 client on asyncio streams, as lean as
the socket's AsyncClient, so that the figures compare the servers, not the clients.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import MINILM, Daemon, corpus, percentiles
from bench_pool import NOOP, workers_of

from modelpool.protocol.client import AsyncClient, Client


class KeepAlive:
    """One HTTP/1.1 connection, one request at a time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _send(self, path: str, payload: Any) -> asyncio.StreamReader:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        body = json.dumps(payload).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        assert self.reader is not None
        return self.reader

    async def _headers(self, reader: asyncio.StreamReader) -> dict[str, str]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        assert status == 200, head
        return {k.lower(): v for k, _, v in (line.decode().partition(": ")
                                            for line in head.split(b"\r\n")[1:] if line)}

    async def post(self, path: str, payload: Any) -> bytes:
        reader = await self._send(path, payload)
        headers = await self._headers(reader)
        return await reader.readexactly(int(headers["content-length"]))

    async def first_event(self, path: str, payload: Any,
                          markers: tuple[bytes, ...] = (b"data: ",)) -> float:
        """Seconds to the first server-sent event holding one of `markers` (chat's first
        chunk; for the Responses API, its first text delta, or its end for an answer
        sampled empty); the rest of the stream is read."""
        t0 = time.perf_counter()
        reader = await self._send(path, payload)
        await self._headers(reader)  # chunked: size line, then the event
        first = None
        while True:
            size = int((await reader.readline()).strip(), 16)
            data = await reader.readexactly(size + 2)
            if first is None and any(marker in data for marker in markers):
                first = time.perf_counter() - t0
            if size == 0 or b"[DONE]" in data:
                if size:
                    await reader.readline()
                    await reader.readexactly(2)
                assert first is not None
                return first

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _daemon(port: int, in_loop: bool, models: str) -> Daemon:
    daemon = Daemon(f"[pool]\ncooldown_idle_s = 3600\n[http]\nlisten = \"127.0.0.1:{port}\"\n"
                    f"in_loop = {str(in_loop).lower()}\n{models}")
    daemon.wait_listening()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return daemon
        time.sleep(0.05)
    raise RuntimeError("the HTTP API did not listen")


async def _single(daemon: Daemon, port: int, rounds: int) -> dict[str, Any]:
    """One text at a time, socket and HTTP interleaved."""
    texts = corpus(rounds, seed=3)
    http = KeepAlive(port)
    sock_lat, http_lat = [], []
    async with AsyncClient(daemon.socket) as c:
        for text in texts[:20]:
            await c.embed(text)
            await http.post("/v1/embeddings", {"input": text})
        for text in texts:
            t0 = time.perf_counter()
            await c.embed(text)
            t1 = time.perf_counter()
            await http.post("/v1/embeddings", {"input": text})
            sock_lat.append(t1 - t0)
            http_lat.append(time.perf_counter() - t1)
    await http.close()
    s, h = percentiles(sock_lat), percentiles(http_lat)
    return {"socket": s, "http": h, "p50_extra_ms": round(h["p50_ms"] - s["p50_ms"], 3),
            "target_extra_ms": 1.0}


async def _in_flight(daemon: Daemon, port: int, texts: list[str], lanes: int,
                     model: str, target: str) -> dict[str, Any]:
    async def by_socket() -> float:
        queue = list(texts)
        async with AsyncClient(daemon.socket) as c:
            async def lane() -> None:
                while queue:
                    await c.embed(queue.pop(), model=model)
            t0 = time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(lanes)))
            return len(texts) / (time.perf_counter() - t0)

    async def by_http() -> float:
        queue = list(texts)
        conns = [KeepAlive(port) for _ in range(lanes)]

        async def lane(conn: KeepAlive) -> None:
            while queue:
                await conn.post("/v1/embeddings", {"input": queue.pop(), "model": model})
        t0 = time.perf_counter()
        await asyncio.gather(*(lane(c) for c in conns))
        rate = len(texts) / (time.perf_counter() - t0)
        for conn in conns:
            await conn.close()
        return rate

    sock_rates, http_rates = [], []
    for _ in range(2):  # alternated, so drift hits both alike
        sock_rates.append(await by_socket())
        http_rates.append(await by_http())
    s, h = max(sock_rates), max(http_rates)
    return {"lanes": lanes, "socket_per_s": round(s, 1), "http_per_s": round(h, 1),
            "ratio": round(h / s, 3), "target": target}


RESPONSE_FIRST = (b"event: response.output_text.delta", b"event: response.completed",
                  b"event: response.incomplete")


async def _ttft(daemon: Daemon, port: int, rounds: int) -> dict[str, Any]:
    """Time to the first streamed token of tiny-llm: socket, HTTP's chat and HTTP's
    Responses API interleaved."""
    http = KeepAlive(port)
    messages = [{"role": "user", "content": "tell me a story"}]
    body = {"model": "tiny-llm", "messages": messages, "max_tokens": 4, "stream": True}
    responses_body = {"model": "tiny-llm", "input": messages, "max_output_tokens": 4,
                      "stream": True}
    sock_lat, http_lat, responses_lat = [], [], []
    async with AsyncClient(daemon.socket) as c:
        for i in range(rounds + 10):
            t0 = time.perf_counter()
            stream = c.generate(messages, model="tiny-llm", max_tokens=4)
            await anext(stream)
            first = time.perf_counter() - t0
            async for _ in stream:
                pass
            over_http = await http.first_event("/v1/chat/completions", body)
            responses = await http.first_event("/v1/responses", responses_body, RESPONSE_FIRST)
            if i >= 10:
                sock_lat.append(first)
                http_lat.append(over_http)
                responses_lat.append(responses)
    await http.close()
    s, h, r = percentiles(sock_lat), percentiles(http_lat), percentiles(responses_lat)
    return {"socket": s, "http": h, "p50_extra_ms": round(h["p50_ms"] - s["p50_ms"], 3),
            "target_extra_ms": 1.0, "responses_api": r,
            "responses_p50_extra_ms": round(r["p50_ms"] - s["p50_ms"], 3)}


async def _socket_beside_http_flood(daemon: Daemon, port: int, seconds: float) -> dict:
    """No-op requests: a socket client's latency alone, then beside 64 HTTP lanes."""
    async def socket_latency(c: AsyncClient, n: int) -> dict[str, float]:
        lat = []
        for i in range(n):
            t0 = time.perf_counter()
            await c.embed(f"s{i}", model="noop")
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.002)
        return percentiles(lat)

    async with AsyncClient(daemon.socket) as c:
        await c.embed("warm", model="noop")
        alone = await socket_latency(c, 500)
        stop = time.perf_counter() + seconds
        served = 0

        async def lane() -> None:
            nonlocal served
            conn = KeepAlive(port)
            while time.perf_counter() < stop:
                await conn.post("/v1/embeddings", {"input": "x", "model": "noop"})
                served += 1
            await conn.close()

        flood = asyncio.gather(*(lane() for _ in range(64)))
        beside = await socket_latency(c, 500)
        await flood
    return {"socket_alone": alone, "socket_beside_http_flood": beside,
            "http_noop_per_s": round(served / seconds, 1)}


def figures(quick: bool) -> dict[str, Any]:
    import make_tiny_models

    tiny = Path(tempfile.mkdtemp(prefix="mpbench-tiny-"))
    make_tiny_models.build_tiny_llm(tiny)
    models = (f'[[models]]\nkey = "tiny-llm"\ncapability = "text_to_text"\n'
              f'path = "{tiny / "tiny-llm"}"\n' + NOOP.format(run_s=0, max_queue=100000))
    out: dict[str, Any] = {}
    for mode, in_loop in (("process", False), ("in_loop", True)):
        port = _free_port()
        daemon = _daemon(port, in_loop, models)
        try:
            with Client(socket_path=daemon.socket, timeout_s=300) as c:
                c.load(MINILM, workers=2)
                c.embed(["warm"] * 64)
                while len([w for w in workers_of(c, MINILM) if w["state"] == "idle"]) < 2:
                    time.sleep(0.1)
            out[mode] = asyncio.run(_mode(daemon, port, quick))
        finally:
            daemon.stop()
    return out


async def _mode(daemon: Daemon, port: int, quick: bool) -> dict[str, Any]:
    texts = corpus(512 if quick else 2048, seed=4)
    return {
        "single_text": await _single(daemon, port, 100 if quick else 400),
        "minilm_64_in_flight": await _in_flight(daemon, port, texts, 64, MINILM, "≥ 0.9x"),
        # What HTTP itself costs per request, with nothing to hide it: no target.
        "noop_64_in_flight": await _in_flight(daemon, port, [f"n{i}" for i in range(
            2000 if quick else 10000)], 64, "noop", "(no target)"),
        "ttft": await _ttft(daemon, port, 50 if quick else 200),
        "flood": await _socket_beside_http_flood(daemon, port, 3 if quick else 8),
    }
