"""Benchmarks of daemons sharing a PostgreSQL job queue on this machine: MiniLM throughput
of one node against two (each pinned to its own core), no-op job latency and rate
through PostgreSQL against direct calls in the same run, and how soon a killed node's
jobs are claimed again after its last lease renewal.

PostgreSQL is the tests' throwaway server (tests/cluster/pg.py: initdb as the postgres
user into a temporary directory), so this needs root and the PostgreSQL binaries.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
from bench import MINILM, ROOT, Daemon, corpus, percentiles
from bench_pool import NOOP

from modelpool.protocol.client import AsyncClient, Client

sys.path.insert(0, str(ROOT / "tests" / "cluster"))
import pg

_databases = itertools.count()


@contextlib.contextmanager
def postgres() -> Iterator[pg.PgServer]:
    reason = pg.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench_cluster: {reason}")
    server = pg.PgServer()
    try:
        server.init()
        yield server
    finally:
        server.destroy()


def start_nodes(server: pg.PgServer, count: int, models: str, pin: bool = False,
                lease_s: float = 10.0) -> tuple[list[Daemon], str]:
    """`count` daemons on a fresh database (returned with them); with pin, node i runs
    on CPU i only."""
    db = server.create_database(f"b{next(_databases)}")
    dsn = server.dsn(dbname=db)
    nodes = []
    for i in range(count):
        config = (f'[cluster]\npostgres = "{dsn}"\nnode_name = "n{i}"\nlease_s = {lease_s}\n'
                  f"[pool]\ncold_start_workers = 1\ncooldown_idle_s = 3600\n{models}")
        nodes.append(Daemon(config, prefix=["taskset", "-c", str(i)] if pin else None))
    for node in nodes:
        node.wait_listening()
    for node in nodes:
        with Client(socket_path=node.socket) as c:
            _wait(lambda c=c: (s := c.status()["cluster"])["reachable"]
                  and len(s["nodes"]) == count, 60)
    return nodes, db


def stop_nodes(nodes: list[Daemon]) -> None:
    for node in nodes:
        if node.process.poll() is None:
            node.stop()


def _wait(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not come up")
        time.sleep(0.05)


def minilm_scaling(server: pg.PgServer, jobs: int, per_job: int) -> dict[str, Any]:
    """Jobs of per_job texts through one node, then through two, each on its own core."""
    texts = corpus(jobs * per_job, seed=2)
    batches = [texts[i:i + per_job] for i in range(0, len(texts), per_job)]
    rates = {}
    for count in (1, 2):
        nodes, _ = start_nodes(server, count, "", pin=True)
        try:
            for node in nodes:  # loaded everywhere before the clock starts
                with Client(socket_path=node.socket) as c:
                    c.load(MINILM, workers=1)
                    c.embed(["warm"] * per_job)
            rates[count] = asyncio.run(_jobs_rate(nodes[0].socket, batches))
        finally:
            stop_nodes(nodes)
    return {"jobs": jobs, "texts_per_job": per_job,
            "one_node_texts_per_s": round(rates[1], 1),
            "two_nodes_texts_per_s": round(rates[2], 1),
            "speedup": round(rates[2] / rates[1], 3)}


async def _jobs_rate(sock: str, batches: list[list[str]]) -> float:
    async with AsyncClient(sock) as c:
        t0 = time.perf_counter()
        keys = [await c.submit("embed", batch, priority="batch") for batch in batches]
        for key in keys:
            await c.retrieve(key, timeout_s=600)
        return sum(map(len, batches)) / (time.perf_counter() - t0)


def noop_latency(server: pg.PgServer, rounds: int) -> dict[str, Any]:
    """One at a time: a direct call against a submit and a retrieve through PostgreSQL."""
    nodes, _ = start_nodes(server, 1, NOOP.format(run_s=0, max_queue=1000))
    try:
        with Client(socket_path=nodes[0].socket) as c:
            c.retrieve(c.submit("embed", "warm", model="noop"))
            direct, jobs = [], []
            for i in range(rounds):  # interleaved, so drift hits both alike
                t0 = time.perf_counter()
                c.embed(f"d{i}", model="noop")
                t1 = time.perf_counter()
                c.retrieve(c.submit("embed", f"j{i}", model="noop"))
                t2 = time.perf_counter()
                direct.append(t1 - t0)
                jobs.append(t2 - t1)
    finally:
        stop_nodes(nodes)
    skip = rounds // 10
    return {"direct": percentiles(direct[skip:]), "submit_and_retrieve": percentiles(jobs[skip:])}


def noop_rate(server: pg.PgServer, jobs: int, lanes: int) -> dict[str, Any]:
    """Two nodes, `lanes` clients each submitting and retrieving no-op jobs, half of them
    on each node: completed jobs per second."""
    nodes, _ = start_nodes(server, 2, NOOP.format(run_s=0, max_queue=10_000))

    async def run() -> float:
        clients = [AsyncClient(node.socket) for node in nodes]
        for c in clients:
            await c.connect()
        counter = iter(range(jobs))

        async def lane(c: AsyncClient) -> None:
            for i in counter:
                await c.retrieve(await c.submit("embed", f"n{i}", model="noop"))
        try:
            await asyncio.gather(*(lane(c) for c in clients))  # warm
            counter = iter(range(jobs))
            t0 = time.perf_counter()
            await asyncio.gather(*(lane(clients[i % 2]) for i in range(lanes)))
            return jobs / (time.perf_counter() - t0)
        finally:
            for c in clients:
                await c.close()
    try:
        rate = asyncio.run(run())
    finally:
        stop_nodes(nodes)
    return {"jobs": jobs, "lanes": lanes, "nodes": 2, "jobs_per_s": round(rate, 1)}


def reclaim_after_kill(server: pg.PgServer, lease_s: float) -> dict[str, Any]:
    """Two nodes running slow jobs; the second is SIGKILLed with its workers. Seconds
    from each of its jobs' last lease renewal to its claim by the other node, read in
    the server's clock."""
    nodes, db = start_nodes(server, 2, NOOP.format(run_s=0.5, max_queue=1000),
                            lease_s=lease_s)
    try:
        with Client(socket_path=nodes[0].socket) as c:
            for i in range(16):
                c.submit("embed", f"slow {i}", model="noop")
        held = _poll(server, db, "SELECT key, lease_until FROM modelpool.jobs WHERE "
                     "node = 'n1' AND state = 'running'", 30)
        for proc in psutil.Process(nodes[1].process.pid).children(recursive=True):
            proc.send_signal(signal.SIGKILL)
        nodes[1].process.send_signal(signal.SIGKILL)
        renewed = {key: until.timestamp() - lease_s for key, until in held}
        claimed: dict[str, float] = {}
        deadline = time.monotonic() + lease_s + 30
        while len(claimed) < len(renewed) and time.monotonic() < deadline:
            with server.connect(dbname=db) as conn:
                rows = conn.execute(
                    "SELECT key, extract(epoch FROM now()) FROM modelpool.jobs WHERE "
                    "key = ANY(%s) AND node <> 'n1' AND node <> ''",
                    (list(renewed),)).fetchall()
            for key, now in rows:
                claimed.setdefault(key, float(now))
            time.sleep(0.01)
    finally:
        stop_nodes(nodes)
    after = [claimed[key] - renewed[key] for key in claimed]
    return {"lease_s": lease_s, "lost_jobs": len(renewed), "reclaimed": len(claimed),
            "max_s_after_last_renewal": round(max(after), 3) if after else None,
            "target_s": lease_s + 1}


def _poll(server: pg.PgServer, db: str, sql: str, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with server.connect(dbname=db) as conn:
            rows = conn.execute(sql).fetchall()
        if rows:
            return rows
        time.sleep(0.02)
    raise TimeoutError(sql)


def figures(quick: bool) -> dict[str, Any]:
    with postgres() as server:
        return {
            "noop_latency": noop_latency(server, 300 if quick else 2000),
            "noop_rate": noop_rate(server, 2000 if quick else 10000, 64),
            "reclaim_after_kill": reclaim_after_kill(server, 10.0),
            "minilm_scaling": minilm_scaling(server, 40 if quick else 200, 32),
        }
