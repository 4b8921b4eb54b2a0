"""Slow, stuck and too many HTTP clients: a body that trickles is answered 408, a request
line and headers that trickle (slowloris) or never come are closed within the same
bound, over-long headers are refused, and past max_clients a newcomer takes the place of
a connection waiting for its request, or is answered 503 while every other is busy; no
such client keeps the others from being served."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest
from conftest import Daemon, model_entry
from http_helpers import (
    KEY,
    http_daemon,
    raw_connection,
    read_to_close,
    status_of,
    trickle,
)

AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CLIENTS = 4
TIMEOUT_S = 2.0  # [http] body_timeout_s: a request's headers, then its body
SLACK_S = 1.5  # a loaded 2-core machine's scheduling, on top of a bound
HEAD = b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    daemon, base = http_daemon(
        tmp_path_factory.mktemp("http-clients"), tiny_models_dir,
        http=f"max_clients = {MAX_CLIENTS}\nbody_timeout_s = {TIMEOUT_S}",
        extra=model_entry("sleepy", run_s=1.5, max_workers=1))
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


def test_a_trickled_body_is_408_and_closed(served: tuple[Daemon, str]) -> None:
    sock = raw_connection(served[1])
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                 b"\r\nAuthorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000"
                 b"\r\n\r\n")
    [(seconds, answer)] = trickle([sock], b'{"input": "' + b"x" * 900, 0.1, 10)
    assert status_of(answer) == 408, answer  # and closed: read_to_close returned
    assert b'"request_timeout"' in answer and b"connection: close" in answer.lower()
    assert TIMEOUT_S - 0.2 < seconds < TIMEOUT_S + SLACK_S


def test_trickled_or_missing_headers_are_closed_within_the_bound(
        served: tuple[Daemon, str]) -> None:
    """Fewer than max_clients: no newcomer needs their places; the deadline closes them."""
    tricklers = [raw_connection(served[1]) for _ in range(MAX_CLIENTS - 2)]
    silent = raw_connection(served[1])
    ends = trickle(tricklers, HEAD, 0.1, 10)
    assert [status_of(answer) for _, answer in ends] == [408] * len(tricklers)
    assert all(TIMEOUT_S - 0.2 < s < TIMEOUT_S + SLACK_S for s, _ in ends), ends
    assert read_to_close(silent, SLACK_S) == b""  # already past its deadline: closed


def test_a_kept_alive_connection_trickling_its_next_request_is_closed(
        served: tuple[Daemon, str]) -> None:
    """The bound starts again after each answer: any byte stops uvicorn's keep-alive
    clock, so it alone would keep this connection for good."""
    sock = raw_connection(served[1])
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    head = b""
    while b'{"status":"ok"}' not in head:
        head += sock.recv(4096)
    assert status_of(head) == 200 and b"connection: close" not in head.lower()
    [(seconds, answer)] = trickle([sock], HEAD, 0.1, 10)
    assert status_of(answer) == 408, answer
    assert TIMEOUT_S - 0.2 < seconds < TIMEOUT_S + SLACK_S


def test_slowloris_does_not_lock_anyone_out(served: tuple[Daemon, str]) -> None:
    """More tricklers than max_clients: a real client is still answered at once, long
    before any trickler's deadline, and every trickler is closed within the bound."""
    tricklers = [raw_connection(served[1]) for _ in range(MAX_CLIENTS + 2)]
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        trickling = pool.submit(trickle, tricklers, HEAD, 0.1, 10)
        time.sleep(0.5)
        with httpx.Client(base_url=served[1], headers=AUTH, timeout=5) as http:
            answers = [http.get("/v1/models").status_code for _ in range(3)]
        answered_after = time.monotonic() - start
        ends = trickling.result()
    assert answers == [200] * 3 and answered_after < TIMEOUT_S - 0.5
    assert all(s < TIMEOUT_S + SLACK_S for s, _ in ends), ends
    assert {status_of(answer) for _, answer in ends} <= {408, None}


def _endless_url(sock: socket.socket, first: bytes = b"") -> None:
    """A megabyte of one URL, until the server closes the connection under it."""
    sock.sendall(first + b"GET /v1/models?q=")
    with contextlib.suppress(OSError):
        for _ in range(64):
            sock.sendall(b"a" * 16384)
            time.sleep(0.001)


def test_over_long_headers_are_431(served: tuple[Daemon, str]) -> None:
    sock = raw_connection(served[1])
    _endless_url(sock)
    answer = read_to_close(sock)
    assert status_of(answer) == 431, answer[:200]
    assert httpx.get(served[1] + "/v1/models", headers=AUTH).status_code == 200


def test_over_long_headers_behind_a_request_close_at_once(served: tuple[Daemon, str]) -> None:
    """Pipelined behind a request (sleepy: 1.5 s) they count too: closed long before
    that request is answered, not after it plus the headers' deadline."""
    body = b'{"model": "sleepy", "input": "x"}'
    sock = raw_connection(served[1])
    start = time.monotonic()
    _endless_url(sock, b"POST /v1/embeddings HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                 + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    read_to_close(sock)
    assert time.monotonic() - start < 1.2


def test_over_max_clients_is_503_while_the_others_are_served(
        served: tuple[Daemon, str]) -> None:
    """max_clients connections each wait on sleepy (1.5 s a batch, one worker): one
    more is answered 503 with Retry-After at once, and each of them gets its answer."""
    assert httpx.post(served[1] + "/v1/embeddings", headers=AUTH, timeout=60, json={
        "model": "sleepy", "input": "warm"}).status_code == 200

    async def run() -> tuple[list[int], httpx.Response, float]:
        limits = httpx.Limits(max_connections=MAX_CLIENTS)
        async with httpx.AsyncClient(base_url=served[1], headers=AUTH, timeout=30,
                                     limits=limits) as http:
            busy = [asyncio.ensure_future(http.post("/v1/embeddings", json={
                "model": "sleepy", "input": f"t{i}"})) for i in range(MAX_CLIENTS)]
            await asyncio.sleep(0.5)
            start = time.monotonic()
            async with httpx.AsyncClient(base_url=served[1], headers=AUTH) as newcomer:
                refused = await newcomer.get("/v1/models")
            took = time.monotonic() - start
            return [r.status_code for r in await asyncio.gather(*busy)], refused, took

    busy, refused, took = asyncio.run(run())
    assert busy == [200] * MAX_CLIENTS
    assert refused.status_code == 503 and took < 1.0
    assert refused.headers["retry-after"].isdigit()
    assert refused.json()["error"]["code"] == "too_many_connections"
    assert httpx.get(served[1] + "/v1/models", headers=AUTH).status_code == 200
