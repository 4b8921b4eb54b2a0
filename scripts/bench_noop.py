"""No-op requests through one daemon: what the supervisor alone sustains.

64 in flight on one connection, and 1,024 in flight over 16 connections (64 each), with
a model that costs nothing (bench_loaders:noop); the supervisor's CPU per request. And
one request at a time, back to back and each after the daemon slept as long as a MiniLM
forward pass takes: what a lone request pays for crossing processes that were asleep.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import bench_machine
import psutil
from bench import Daemon
from bench_pool import NOOP

from modelpool.protocol.client import AsyncClient, Client


async def _run(sock: str, requests: int, connections: int, in_flight: int) -> float:
    queue = [f"t{i}" for i in range(requests)]

    async def lane(c: AsyncClient) -> None:
        while queue:
            await c.embed(queue.pop(), model="noop")

    clients = [AsyncClient(sock) for _ in range(connections)]
    for c in clients:
        await c.__aenter__()
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(lane(c) for c in clients for _ in range(in_flight)))
        return time.perf_counter() - t0
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)


def _lone(c: Client, rounds: int, idle_ms: float = 8.0) -> dict[str, Any]:
    texts = (f"t{i}" for i in itertools.count())

    def round_trip() -> float:
        t0 = time.perf_counter()
        c.embed(next(texts), model="noop")
        return time.perf_counter() - t0

    return bench_machine.wakeup_figures(round_trip, rounds, idle_ms)


def figures(requests: int) -> dict[str, Any]:
    daemon = Daemon("[pool]\ncold_start_workers = 1\n"
                    + NOOP.format(run_s=0, max_queue=100000))
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.embed("warm", model="noop")
            out: dict[str, Any] = {"lone": _lone(c, 300)}
        sup = psutil.Process(daemon.process.pid)
        for name, connections, in_flight in (("in_flight_64", 1, 64),
                                             ("in_flight_1024_16_connections", 16, 64)):
            cpu0 = sum(sup.cpu_times()[:2])
            wall = asyncio.run(_run(daemon.socket, requests, connections, in_flight))
            cpu = sum(sup.cpu_times()[:2]) - cpu0
            out[name] = {"requests_per_s": round(requests / wall, 1),
                         "supervisor_cpu_us_per_request": round(cpu / requests * 1e6, 1)}
        return out
    finally:
        daemon.stop()
