"""Several daemons, each in its own network namespace as if on its own host, sharing one
PostgreSQL over their veth links: every job gets exactly one result, a killed or cut-off
node's jobs finish elsewhere, a model loaded on one node serves jobs while another node
loads something else, and a PostgreSQL crash mid-run loses no accepted job."""

from __future__ import annotations

import collections
import itertools
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import netns
import numpy as np
import pg
import pytest
from cluster_helpers import (
    Daemon,
    Database,
    fresh_database,
    model_entry,
    model_status,
    node_config,
    peer_serves,
    start_node,
    wait_until,
)

from modelpool.protocol.errors import ErrorCode, PoolError

DIM = 8
LEASE_S = 3.0
PRIORITIES = ("low", "normal", "high", "critical")


class Hosts:
    def __init__(self, spaces: netns.NetNamespaces, server: pg.PgServer) -> None:
        self.spaces = spaces
        self.server = server
        self.daemons: list[Daemon] = []

    def start(self, workdir: Path, database: Database, index: int, models: str,
              extra: str = "") -> Daemon:
        dsn = database.dsn_at(self.spaces.host_address(index))
        config = node_config(dsn, f"n{index}", models, lease_s=LEASE_S, extra=extra)
        # Host i's vectors end with i + 1: one config everywhere, so every node runs
        # every node's jobs.
        daemon = start_node(workdir / f"n{index}", config, self.spaces.command(index, []),
                            env={"MP_TEST_MARK": str(index + 1)})
        self.daemons.append(daemon)
        return daemon

    def stop_all(self) -> None:
        for daemon in self.daemons:
            for child in daemon.descendants():
                child.kill()
            if daemon.process.poll() is None:
                daemon.process.kill()
            daemon.process.wait(10)
        self.daemons = []


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    for reason in (pg.unavailable_reason(), netns.unavailable_reason()):
        if reason is not None:
            pytest.skip(reason)
    with netns.NetNamespaces(3) as spaces:
        server = pg.PgServer(listen=spaces.host_addresses())
        try:
            server.init()
            yield Hosts(spaces, server)
        finally:
            server.destroy()


@pytest.fixture
def cluster(hosts: Hosts) -> Iterator[tuple[Hosts, Database]]:
    database = fresh_database(hosts.server)
    try:
        yield hosts, database
    finally:
        hosts.stop_all()
        hosts.spaces.links_up()


def embedders(run_s: float, max_workers: int = 1) -> str:
    return "".join(model_entry(key, run_s=run_s, max_workers=max_workers)
                   for key in ("m1", "m2"))


def connected(daemon: Daemon, peers: int) -> None:
    with daemon.client() as c:
        wait_until(lambda: (s := c.status()["cluster"])["reachable"]
                   and len(s["nodes"]) == peers + 1, 30, f"{daemon.socket_path} sees its peers")


def held_by(database: Database, node: str) -> list[str]:
    return [str(row[0]) for row in database.query(
        "SELECT key FROM modelpool.jobs WHERE node = %s AND state = 'running'", (node,))]


def ended_elsewhere(database: Database, keys: list[str], node: str) -> bool:
    rows = database.query("SELECT state, node FROM modelpool.jobs WHERE key = ANY(%s)", (keys,))
    return len(rows) == len(keys) and all(row == ("done", row[1]) and row[1] != node
                                          for row in rows)


def test_three_nodes_give_every_one_of_2000_jobs_exactly_one_result(
        cluster: tuple[Hosts, Database], tmp_path: Path) -> None:
    hosts, database = cluster
    daemons = [hosts.start(tmp_path, database, i, embedders(run_s=0.002) +
                           model_entry("gen", "counting_generator", "text_to_text",
                                       step_s=0.001))
               for i in range(3)]
    for daemon in daemons:
        connected(daemon, 2)
    clients = [daemon.client() for daemon in daemons]
    try:
        jobs: list[tuple[str, str, str]] = []  # (key, kind, text)
        for i in range(2000):
            c, text, priority = clients[i % 3], f"job {i} " + "x" * (i % 11), PRIORITIES[i % 4]
            if i % 10 == 9:
                key = c.submit("generate", text, model="gen", max_tokens=2, priority=priority)
                jobs.append((key, "gen", text))
            else:
                model = ("m1", "m2")[i % 2]
                jobs.append((c.submit("embed", text, model=model, priority=priority),
                             model, text))
        results = [clients[(i + 1) % 3].retrieve(key, 60) for i, (key, _, _) in
                   enumerate(jobs)]
        # Each node's figures reach the others with its next beat.
        stats = wait_until(lambda: (s := clients[0].stats())["completed"] >= 2000 and s,
                           10, "the cluster's totals count every job")
    finally:
        for c in clients:
            c.close()
    marks: set[float] = set()
    for (_, kind, text), result in zip(jobs, results, strict=True):
        if kind == "gen":
            assert result.text == "tok0 tok1 "
        else:
            vector = np.asarray(result).tolist()
            assert vector[:DIM - 1] == [float(len(text)), *map(float, range(1, DIM - 1))]
            marks.add(vector[-1])
    assert database.query("SELECT state, count(*) FROM modelpool.jobs GROUP BY state") \
        == [("done", 2000)]
    assert len(marks) >= 2  # the work was shared
    assert stats["nodes"] == 3 and stats["duplicate_results"] == 0  # each ran to one end


def _start_three(hosts: Hosts, database: Database, tmp_path: Path) -> list[Daemon]:
    """Three nodes with m1 serving on each: what the reclaim tests time is the lease and
    the sweep, not a survivor's first worker start (seconds while three forkservers
    import at once on two cores)."""
    daemons = [hosts.start(tmp_path, database, i, embedders(run_s=0.3, max_workers=2))
               for i in range(3)]
    serving_everywhere(daemons, ["m1"], workers=2)
    return daemons


def serving_everywhere(daemons: list[Daemon], keys: list[str], workers: int) -> None:
    """Every node connected to the others, with these models loaded and idle."""
    for daemon in daemons:
        connected(daemon, len(daemons) - 1)
        with daemon.client() as c:
            for key in keys:
                c.load(key, workers=workers)
    for daemon in daemons:
        for key in keys:
            _wait_serving(daemon, key, workers)


def _wait_serving(daemon: Daemon, key: str, workers: int) -> None:
    """The model's workers on this node all idle; if not in time, what they were and the
    end of the node's log."""
    states: list[str] = []

    def serving() -> bool:
        with daemon.client() as c:
            states[:] = [w["state"] for w in model_status(c.status(), key)["workers"]]
        return states == ["idle"] * workers

    try:
        wait_until(serving, 60, f"{key} serving on every node")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {daemon.socket_path}: {states}\n"
                             f"{daemon.log()[-3000:]}") from None


def _submit_until_held(daemons: list[Daemon], database: Database) -> list[tuple[str, str]]:
    """Jobs submitted through the third node (which claims those its free workers can
    start as it writes them) until it runs some; (key, text) each."""
    jobs: list[tuple[str, str]] = []
    with daemons[2].client() as c:
        for i in range(12):
            text = f"lost {i}"
            jobs.append((c.submit("embed", text, model="m1"), text))
        wait_until(lambda: held_by(database, "n2"), 20, "the third node runs jobs")
    return jobs


def test_a_killed_nodes_jobs_finish_elsewhere_within_its_lease(
        cluster: tuple[Hosts, Database], tmp_path: Path) -> None:
    hosts, database = cluster
    daemons = _start_three(hosts, database, tmp_path)
    jobs = _submit_until_held(daemons, database)
    for child in daemons[2].descendants():  # the host goes: every process on it
        child.send_signal(signal.SIGKILL)
    daemons[2].process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    lost = held_by(database, "n2")  # what it held when it died (not what it finished)
    assert lost
    wait_until(lambda: ended_elsewhere(database, lost, "n2"), LEASE_S + 10, "lost jobs done")
    took_s = time.monotonic() - killed
    assert took_s <= LEASE_S + 2, f"{len(lost)} lost jobs done {took_s:.2f}s after the kill"
    with daemons[0].client() as c:
        results = [np.asarray(c.retrieve(key, 30)).tolist() for key, _ in jobs]
    assert all(r[0] == len(text) for r, (_, text) in zip(results, jobs, strict=True))


def test_a_cut_off_node_completes_nothing_it_lost_when_it_comes_back(
        cluster: tuple[Hosts, Database], tmp_path: Path) -> None:
    hosts, database = cluster
    daemons = _start_three(hosts, database, tmp_path)
    jobs = _submit_until_held(daemons, database)
    hosts.spaces.link_down(2)
    cut = time.monotonic()
    lost = held_by(database, "n2")  # what it held when cut off: it can store nothing now
    assert lost
    wait_until(lambda: ended_elsewhere(database, lost, "n2"), LEASE_S + 10, "lost jobs done")
    took_s = time.monotonic() - cut
    time.sleep(1.0)  # the cut-off node finishes what it was running, unable to store it
    hosts.spaces.link_up(2)
    with daemons[2].client() as c:
        wait_until(lambda: c.status()["cluster"]["reachable"], 30, "the node reconnects")
        wait_until(lambda: c.stats()["duplicate_results"] >= 1, 10,
                   "its late results are dropped")
        after = c.submit("embed", "back", model="m1")
        assert np.asarray(c.retrieve(after, 30)).tolist()[0] == len("back")
    assert ended_elsewhere(database, lost, "n2")  # still: nothing overwritten
    with daemons[0].client() as c:
        marks = {np.asarray(c.retrieve(key, 30)).tolist()[-1] for key in lost}
        assert all(c.retrieve(key, 30) is not None for key, _ in jobs)
    assert 3.0 not in marks  # no result of the cut-off node's stands
    assert took_s <= LEASE_S + 2, f"{len(lost)} lost jobs done {took_s:.2f}s after the cut"


def test_a_model_loaded_on_one_node_serves_while_another_node_loads(
        cluster: tuple[Hosts, Database], tmp_path: Path) -> None:
    hosts, database = cluster

    models = model_entry("warm", run_s=0.05) + model_entry("cold", load_s=8)
    a = hosts.start(tmp_path, database, 0, models)  # its vectors end with 1
    b = hosts.start(tmp_path, database, 1, models)  # and b's with 2
    with b.client() as cb:
        assert np.asarray(cb.embed("warm up", model="warm")).tolist()[-1] == 2
    with a.client() as ca:
        wait_until(lambda: peer_serves(ca.status(), "n1", "warm"), 20, "a sees b serve it")
        first = ca.submit("embed", "first", model="warm")
        assert np.asarray(ca.retrieve(first, 30)).tolist()[-1] == 2  # b has room: b runs it
        assert model_status(ca.status(), "warm")["workers"] == []  # and a loads nothing for it
        ca.load("cold")
        started = time.monotonic()
        keys = [ca.submit("embed", f"w{i}", model="warm") for i in range(10)]
        marks = [np.asarray(ca.retrieve(key, 30)).tolist()[-1] for key in keys]
        direct = np.asarray(ca.embed("routed", model="warm")).tolist()
        took_s = time.monotonic() - started
        cold = model_status(ca.status(), "cold")
    assert took_s < 6, f"jobs for b's model took {took_s:.1f}s beside a's load"
    assert cold["state"] == "loading"  # they did not wait for it
    assert marks.count(2) >= 9  # b ran them (a may start one as b is busy)
    assert direct[-1] == 2  # a direct request went through the shared queue to b


class Feed:
    """Jobs of two models submitted to every node, a thread each, until stopped; each
    submit's outcome is kept under the phase of the run it began in."""

    def __init__(self, daemons: list[Daemon]) -> None:
        self.phase = "before"
        self.accepted: list[tuple[str, str, str]] = []  # (phase, key, text)
        self.refused: collections.Counter[str] = collections.Counter()  # UNAVAILABLE
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = ThreadPoolExecutor(len(daemons))
        self._runs = [self._threads.submit(self._run, d, i) for i, d in enumerate(daemons)]

    def count(self, phase: str) -> int:
        with self._lock:
            return sum(1 for p, _, _ in self.accepted if p == phase)

    def stop(self) -> None:
        self._stop.set()
        try:
            for run in self._runs:
                run.result(timeout=30)  # a thread's unexpected error is raised here
        finally:
            self._threads.shutdown(wait=False)

    def _run(self, daemon: Daemon, node: int) -> None:
        with daemon.client(timeout_s=20) as c:
            for i in itertools.count():
                if self._stop.is_set():
                    return
                phase, text = self.phase, f"n{node} job {i} " + "x" * (i % 7)
                try:
                    key = c.submit("embed", text, model=("m1", "m2")[i % 2])
                except PoolError as exc:
                    if exc.code is not ErrorCode.UNAVAILABLE:
                        raise
                    with self._lock:
                        self.refused[phase] += 1
                else:
                    with self._lock:
                        self.accepted.append((phase, key, text))
                time.sleep(0.005)


OUTAGE_S = 4.0  # longer than a submit's wait for a connection (3 s) and than LEASE_S


def one_job_at_a_time() -> str:
    """m1 and m2, one worker each, one job per batch: a backlog builds up as jobs come."""
    return "".join(model_entry(key, run_s=0.04, max_workers=1).rstrip()
                   + "\n        max_batch = 1\n" for key in ("m1", "m2"))


def job_states(database: Database) -> collections.Counter[str]:
    rows = database.query("SELECT state, count(*) FROM modelpool.jobs GROUP BY state")
    return collections.Counter({str(state): int(n) for state, n in rows})  # type: ignore[call-overload]


def test_a_postgres_crash_mid_run_loses_no_accepted_job(
        cluster: tuple[Hosts, Database], tmp_path: Path) -> None:
    hosts, database = cluster
    database.durable_commits()
    daemons = [hosts.start(tmp_path, database, i, one_job_at_a_time())
               for i in range(3)]
    serving_everywhere(daemons, ["m1", "m2"], workers=1)
    feed = Feed(daemons)
    try:
        wait_until(lambda: feed.count("before") >= 150 and job_states(database)["done"] >= 30,
                   30, "jobs run before the crash")
        feed.phase = "during"
        at_crash = job_states(database)
        hosts.server.kill()  # as a crash: backends gone, connections broken
        time.sleep(OUTAGE_S)
        hosts.server.start()  # crash recovery on the same data directory and port
        feed.phase = "after"
        wait_until(lambda: feed.count("after") >= 100, 30, "jobs accepted after the restart")
    finally:
        hosts.server.start()  # for the next tests, should this one fail during the outage
        feed.stop()
    _every_accepted_job_has_one_result(daemons, database, feed, at_crash)


def _every_accepted_job_has_one_result(daemons: list[Daemon], database: Database, feed: Feed,
                                       at_crash: collections.Counter[str]) -> None:
    keys = [key for _, key, _ in feed.accepted]
    wait_until(lambda: set(job_states(database)) == {"done"}, 30, "every job ended")
    done = {str(k): int(a) for k, a in database.query(  # type: ignore[call-overload]
        "SELECT key, attempt FROM modelpool.jobs WHERE state = 'done'")}
    with daemons[1].client() as c:
        results = [np.asarray(c.retrieve(key, 20)).tolist() for key in keys]
        stats = wait_until(lambda: (s := c.stats())["nodes"] == 3
                           and s["completed"] >= len(done) and s, 10, "every node's figures")
    reruns = sum(attempt - 1 for attempt in done.values())  # lost claims, re-claimed
    summary = (f"accepted {collections.Counter(p for p, _, _ in feed.accepted)}, refused "
               f"{feed.refused}, at the crash {at_crash}; {len(done) - len(keys)} stored but "
               f"never acknowledged, {reruns} claims lost, {stats['duplicate_results']} "
               "duplicate results dropped")
    print(summary)
    assert at_crash["queued"] + at_crash["running"] > 0, summary  # work was in flight
    assert feed.refused.total() > 0, summary  # clients saw the outage: UNAVAILABLE
    assert feed.count("after") >= 100 and len(set(keys)) == len(keys), summary
    assert set(keys) <= set(done), summary  # every accepted job ended, done
    for (_, _, text), vector in zip(feed.accepted, results, strict=True):
        assert vector[:DIM - 1] == [float(len(text)), *map(float, range(1, DIM - 1))]
        assert vector[-1] in (1.0, 2.0, 3.0)
    # A result is dropped only when its node lost the claim, which another claim followed.
    assert stats["duplicate_results"] <= reruns, summary
