"""Benchmarks of daemons sharing a PostgreSQL job queue on this machine: MiniLM throughput
of one node against two (each pinned to its own core), no-op job latency and rate
through PostgreSQL against direct calls in the same run, how soon a killed node's
jobs are claimed again after its last lease renewal, a stream relayed by a node that
does not run its model against the same stream asked of the node that does, and a
streamed job followed through either node. Each
figure is printed beside issue 16's target for it ("target", and whether it was
"met"), where it has one.

The daemons reach PostgreSQL over TCP on 127.0.0.1, as the targets say ("through
Postgres on loopback"); the no-op figures are also taken over its Unix socket, beside.
PostgreSQL is the tests' throwaway server (tests/cluster/pg.py: initdb as the postgres
user into a temporary directory; fsync and synchronous_commit off), so this needs root
and the PostgreSQL binaries.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psutil
from bench import MINILM, ROOT, Daemon, corpus, percentiles
from bench_pool import NOOP

from modelpool.protocol.client import AsyncClient, Client

sys.path.insert(0, str(ROOT / "tests" / "cluster"))
import pg

_databases = itertools.count()
LOOPBACK = "127.0.0.1"  # where the nodes reach PostgreSQL; None: its Unix socket


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


def start_nodes(server: pg.PgServer, count: int, models: str | list[str], pin: bool = False,
                lease_s: float = 10.0, host: str | None = LOOPBACK) -> tuple[list[Daemon], str]:
    """`count` daemons on a fresh database (returned with them), reaching PostgreSQL at
    `host` over TCP (None: its Unix socket); with pin, node i runs on CPU i only. Each
    node's models: the same, or node i's `models[i]`."""
    db = server.create_database(f"b{next(_databases)}")
    dsn = server.dsn(host, dbname=db)
    nodes = []
    for i in range(count):
        named = models if isinstance(models, str) else models[i]
        config = (f'[cluster]\npostgres = "{dsn}"\nnode_name = "n{i}"\nlease_s = {lease_s}\n'
                  f"[pool]\ncold_start_workers = 1\ncooldown_idle_s = 3600\n{named}")
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


def minilm_scaling(server: pg.PgServer, jobs: int, per_job: int,
                   rounds: int = 2) -> dict[str, Any]:
    """Jobs of per_job texts through one node, then through two, each on its own core;
    alternated `rounds` times and the best of each kept: one run of either moved by
    15% from run to run on this shared machine, which one pair turned into the ratio."""
    texts = corpus(jobs * per_job, seed=2)
    batches = [texts[i:i + per_job] for i in range(0, len(texts), per_job)]
    samples: dict[int, list[float]] = {1: [], 2: []}
    for count in (1, 2) * rounds:
        nodes, _ = start_nodes(server, count, "", pin=True)
        try:
            for node in nodes:  # loaded everywhere before the clock starts
                with Client(socket_path=node.socket) as c:
                    c.load(MINILM, workers=1)
                    c.embed(["warm"] * per_job)
            samples[count].append(asyncio.run(_jobs_rate(nodes[0].socket, batches)))
        finally:
            stop_nodes(nodes)
    rates = {count: max(runs) for count, runs in samples.items()}
    speedup = rates[2] / rates[1]
    return {"jobs": jobs, "texts_per_job": per_job,
            "one_node_texts_per_s": round(rates[1], 1),
            "two_nodes_texts_per_s": round(rates[2], 1),
            "runs_texts_per_s": {count: [round(r, 1) for r in runs]
                                 for count, runs in samples.items()},
            "speedup": round(speedup, 3), "target": "two nodes >= 1.8x one node",
            "met": speedup >= 1.8, "in_process_ceiling": parallel_ceiling(texts, per_job)}


def parallel_ceiling(texts: list[str], per_job: int, seconds: float = 15.0) -> dict[str, Any]:
    """What this machine gives two cores at this moment, without modelpool: MiniLM (the
    daemon's runtime, one thread) embedding batches of per_job texts in one process on
    CPU 0, then in two at once on CPUs 0 and 1. Other users of a shared machine take
    their share of both cores when both are busy, which two nodes pay and one does not."""
    rates: dict[int, float] = {}
    for cpus in ([0], [0, 1]):
        ctx = multiprocessing.get_context("spawn")
        start, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_embed_on, args=(cpu, texts, per_job, seconds, start,
                                                      results)) for cpu in cpus]
        for proc in procs:
            proc.start()
        ready = [results.get(timeout=300) for _ in procs]  # loaded and warm
        start.set()
        rates[len(cpus)] = sum(results.get(timeout=seconds + 60) for _ in ready)
        for proc in procs:
            proc.join(30)
    return {"one_process_texts_per_s": round(rates[1], 1),
            "two_processes_texts_per_s": round(rates[2], 1),
            "ratio": round(rates[2] / rates[1], 3)}


def _embed_on(cpu: int, texts: list[str], per_job: int, seconds: float, start: Any,
              results: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    import bench_targets

    model = bench_targets._model("onnx", 1)
    batches = [texts[i:i + per_job] for i in range(0, len(texts), per_job)]
    model.embed(batches[0])
    results.put("ready")
    start.wait()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model.embed(batches[done % len(batches)])
        done += 1
    results.put(done * per_job / (time.perf_counter() - t0))


async def _jobs_rate(sock: str, batches: list[list[str]]) -> float:
    async with AsyncClient(sock) as c:
        t0 = time.perf_counter()
        keys = [await c.submit("embed", batch, priority="batch") for batch in batches]
        for key in keys:
            await c.retrieve(key, timeout_s=600)
        return sum(map(len, batches)) / (time.perf_counter() - t0)


def noop_latency(server: pg.PgServer, rounds: int) -> dict[str, Any]:
    """One at a time: a direct call, and a submit and a retrieve through PostgreSQL over
    TCP on loopback (the target's) and over its Unix socket: a node each, on a database
    each, the three interleaved round by round so that drift hits them alike."""
    tcp, _ = start_nodes(server, 1, NOOP.format(run_s=0, max_queue=1000), host=LOOPBACK)
    unix, _ = start_nodes(server, 1, NOOP.format(run_s=0, max_queue=1000), host=None)
    samples: dict[str, list[float]] = {"direct": [], "tcp": [], "unix": []}
    try:
        with Client(socket_path=tcp[0].socket) as ct, Client(socket_path=unix[0].socket) as cu:
            for c in (ct, cu):
                c.retrieve(c.submit("embed", "warm", model="noop"))
            for i in range(rounds):
                t0 = time.perf_counter()
                ct.embed(f"d{i}", model="noop")
                t1 = time.perf_counter()
                ct.retrieve(ct.submit("embed", f"t{i}", model="noop"))
                t2 = time.perf_counter()
                cu.retrieve(cu.submit("embed", f"u{i}", model="noop"))
                t3 = time.perf_counter()
                for name, took in (("direct", t1 - t0), ("tcp", t2 - t1), ("unix", t3 - t2)):
                    samples[name].append(took)
    finally:
        stop_nodes(tcp + unix)
    skip = rounds // 10
    through = {name: percentiles(taken[skip:]) for name, taken in samples.items()}
    return {"direct": through["direct"], "submit_and_retrieve_tcp_loopback": through["tcp"],
            "submit_and_retrieve_unix_socket": through["unix"],
            "target": "submit -> result p50 <= 3 ms through PostgreSQL on loopback (TCP)",
            "met": through["tcp"]["p50_ms"] <= 3.0}


TICKER = """
[[models]]
key = "ticker"
capability = "text_to_text"
loader = "bench_loaders:ticker"
options = {{ step_s = {step_s} }}
"""


# A way to ask for a stream of the two nodes' clients (the one running the model first):
# what is done before it is timed (a submission), then the stream itself
Way = tuple[Callable[[Client, Client], Any], Callable[[Client, Client, Any], Iterable[Any]]]


def relayed_stream(server: pg.PgServer, rounds: int, tokens: int = 20,
                   step_s: float = 0.005) -> dict[str, Any]:
    """A stream of `tokens` tokens, one each step_s, asked of the node that runs its
    model and of a node whose config does not name it (so that it relays it through
    PostgreSQL), in turns: the first token's time and the whole stream's, and how many
    chunks the relayed client got (1: the whole text at the end)."""
    def asked(which: int) -> Way:
        return (lambda runner, other: None, lambda runner, other, _: (runner, other)[
            which].generate("go", model="ticker", max_tokens=tokens))

    return _streams_in_turns(server, rounds, tokens, step_s,
                             {"direct": asked(0), "relayed": asked(1)})


def followed_stream(server: pg.PgServer, rounds: int, tokens: int = 20,
                    step_s: float = 0.005) -> dict[str, Any]:
    """A streamed job submitted to one node and run by the other, followed as it runs
    through the node it was submitted to (which keeps its chunks) or through the node
    that runs it (which asks the keeper for them), in turns: as relayed_stream."""
    def submitted(runner: Client, keeper: Client) -> str:
        return keeper.submit("generate", "go", model="ticker", max_tokens=tokens, stream=True)

    return _streams_in_turns(server, rounds, tokens, step_s, {
        "keeper": (submitted, lambda runner, keeper, key: keeper.follow(key)),
        "other": (submitted, lambda runner, keeper, key: runner.follow(key))})


def _streams_in_turns(server: pg.PgServer, rounds: int, tokens: int, step_s: float,
                      ways: dict[str, Way]) -> dict[str, Any]:
    """Each way's stream `rounds` times, in turns after five each to warm up."""
    nodes, _ = start_nodes(server, 2, [TICKER.format(step_s=step_s), ""])
    samples: dict[str, dict[str, list[float]]] = {
        name: {"first": [], "whole": [], "chunks": []} for name in ways}
    try:
        with Client(socket_path=nodes[0].socket) as runner, \
                Client(socket_path=nodes[1].socket) as other:
            for name in itertools.islice(itertools.cycle(ways), len(ways) * (rounds + 5)):
                before, stream = ways[name]
                made = before(runner, other)
                t0, parts = time.perf_counter(), []
                for part in stream(runner, other, made):
                    parts.append((time.perf_counter() - t0, part.text))
                for figure, value in (("first", parts[0][0]), ("whole", parts[-1][0]),
                                      ("chunks", len([p for p in parts if p[1]]))):
                    samples[name][figure].append(value)
    finally:
        stop_nodes(nodes)
    return {"tokens": tokens, "step_ms": step_s * 1000, **{
        name: {"first_token": percentiles(taken["first"][5:]),
               "whole_stream": percentiles(taken["whole"][5:]),
               "chunks_mean": round(sum(taken["chunks"][5:]) / rounds, 1)}
        for name, taken in samples.items()}}


def noop_rate(server: pg.PgServer, jobs: int, lanes: int, host: str | None) -> dict[str, Any]:
    """Two nodes, `lanes` clients each submitting and retrieving no-op jobs, half of them
    on each node: completed jobs per second (after a warm-up of a tenth as many), with
    PostgreSQL's committed statements and each kind of process's CPU time per job."""
    nodes, db = start_nodes(server, 2, NOOP.format(run_s=0, max_queue=10_000), host=host)

    async def run() -> tuple[float, float, dict[str, float]]:
        clients = [AsyncClient(node.socket) for node in nodes]
        for c in clients:
            await c.connect()
        counter = iter(range(jobs, jobs + jobs // 10))  # the warm-up's own texts

        async def lane(c: AsyncClient) -> None:
            for i in counter:
                await c.retrieve(await c.submit("embed", f"n{i}", model="noop"))
        try:
            await asyncio.gather(*(lane(clients[i % 2]) for i in range(lanes)))  # warm
            counter = iter(range(jobs))
            commits, cpu = _commits(server, db), _cpu_by_kind(nodes)
            t0 = time.perf_counter()
            await asyncio.gather(*(lane(clients[i % 2]) for i in range(lanes)))
            wall = time.perf_counter() - t0
            cpu = {k: v - cpu.get(k, 0.0) for k, v in _cpu_by_kind(nodes).items()}
            await asyncio.sleep(1.1)  # PostgreSQL publishes its counters once a second
            return wall, _commits(server, db) - commits, cpu
        finally:
            for c in clients:
                await c.close()
    try:
        wall, commits, cpu = asyncio.run(run())
    finally:
        stop_nodes(nodes)
    rate = jobs / wall
    return {"postgres_via": host or "unix socket", "jobs": jobs, "lanes": lanes, "nodes": 2,
            "jobs_per_s": round(rate, 1), "statements_per_job": round(commits / jobs, 2),
            "cpu_ms_per_job": {k: round(v * 1000 / jobs, 3) for k, v in cpu.items()},
            "target": ">= 1,000 no-op jobs/s with 2 nodes", "met": rate >= 1000}


def _commits(server: pg.PgServer, db: str) -> int:
    """Transactions committed in the database: one per statement on autocommit."""
    with server.connect(dbname="postgres", user=pg.SUPERUSER) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                           (db,)).fetchone()
    assert row is not None
    return int(row[0])


def _cpu_by_kind(nodes: list[Daemon]) -> dict[str, float]:
    """CPU seconds so far of the supervisors, their workers, PostgreSQL and this client."""
    out = {"supervisors": 0.0, "workers": 0.0, "postgres": 0.0, "client": 0.0}
    daemons = [psutil.Process(node.process.pid) for node in nodes]
    for kind, procs in (("supervisors", daemons),
                        ("workers", [c for d in daemons for c in d.children(recursive=True)]),
                        ("postgres", [p for p in psutil.process_iter(["username"])
                                      if p.info["username"] == pg.PG_USER]),
                        ("client", [psutil.Process()])):
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                out[kind] += sum(proc.cpu_times()[:2])
    return out


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
    worst = max(after) if after else None
    return {"lease_s": lease_s, "lost_jobs": len(renewed), "reclaimed": len(claimed),
            "max_s_after_last_renewal": round(worst, 3) if worst is not None else None,
            "target": f"<= lease_s + 1 = {lease_s + 1:g} s after the last renewal",
            "met": worst is not None and len(claimed) == len(renewed)
            and worst <= lease_s + 1}


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
    rounds, jobs = (300, 2000) if quick else (2000, 10000)
    load_before = os.getloadavg()
    with postgres() as server:
        report = {
            "noop_latency": noop_latency(server, rounds),
            "noop_rate": {"tcp": noop_rate(server, jobs, 64, LOOPBACK),
                          "unix": noop_rate(server, jobs, 64, None)},
            "reclaim_after_kill": reclaim_after_kill(server, 10.0),
            "relayed_stream": relayed_stream(server, 30 if quick else 200),
            "followed_stream": followed_stream(server, 30 if quick else 200),
            "minilm_scaling": minilm_scaling(server, 40 if quick else 200, 32),
        }
    return {"load_average_before": load_before, "load_average_after": os.getloadavg(),
            **report}
