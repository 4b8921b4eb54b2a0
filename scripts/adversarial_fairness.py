#!/usr/bin/env python
"""The split of dispatches between a flooding and a polite client at equal priority,
against a real daemon with a fake model (tests/integration/mp_test_loaders.py). Part of
scripts/adversarial_pool.py's figures; run as `adversarial_fairness.py flood SOCKET
CONNECTIONS IN_FLIGHT` it is the flooding client, a process of its own (as another user
when the case asks for one)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from adversarial_daemon import ROOT, integration, model_status, serving

FAIR = """
[daemon]
socket_group = "postgres"
[access]
allow_users = ["postgres"]
[pool]
cold_start_workers = 1

[[models]]
key = "fair"
capability = "text_embedding"
loader = "mp_test_loaders:slow_embedder"
options = {{ run_s = 0.01 }}
max_workers = 1
max_batch = 1
max_queue = {max_queue}
"""


async def flood(socket_path: str, connections: int, in_flight: int) -> dict[str, Any]:
    """Keeps in_flight requests waiting over `connections` connections until stdin
    closes; returns when each was answered (time.monotonic, the same in every process)."""
    from modelpool.protocol.async_client import AsyncClient
    from modelpool.protocol.client import PoolError

    clients = [await AsyncClient(socket_path).connect() for _ in range(connections)]
    done: list[float] = []
    errors: Counter[str] = Counter()
    stop = asyncio.Event()

    async def lane(lane_no: int) -> None:
        client = clients[lane_no % connections]
        for n in range(10**9):
            if stop.is_set():
                return
            try:  # distinct texts: identical requests would be deduplicated
                await client.embed(f"flood {lane_no} {n}", model="fair")
                done.append(time.monotonic())
            except PoolError as exc:
                errors[exc.code.value] += 1
                await asyncio.sleep(0.01)

    lanes = [asyncio.ensure_future(lane(i)) for i in range(in_flight)]
    print("flooding", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    stop.set()
    for task in lanes:
        task.cancel()
    for client in clients:
        await client.close()
    return {"done": done, "errors": dict(errors)}


async def polite(socket_path: str, in_flight: int, seconds: float) -> list[float]:
    """Keeps in_flight requests going for `seconds`; when each was answered."""
    from modelpool.protocol.async_client import AsyncClient

    done: list[float] = []
    async with AsyncClient(socket_path) as client:
        deadline = time.monotonic() + seconds

        async def lane(lane_no: int) -> None:
            for n in range(10**9):
                if time.monotonic() >= deadline:
                    return
                await client.embed(f"polite {lane_no} {n}", model="fair")
                done.append(time.monotonic())

        await asyncio.gather(*(lane(i) for i in range(in_flight)))
    return done


def wait_queued(daemon: Any, count: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    with daemon.client() as c:
        while time.monotonic() < deadline:
            if model_status(c.status(), "fair")["queued"] >= count:
                return
            time.sleep(0.05)
    raise RuntimeError(f"the flood never had {count} requests waiting")


def fairness_case(connections: int, other_user: bool, seconds: float,
                  in_flight: int = 200, polite_in_flight: int = 2) -> dict[str, Any]:
    helpers = integration()
    with serving(FAIR.format(max_queue=max(1000, 3 * in_flight))) as daemon:
        with daemon.client() as c:
            c.embed("warm", model="fair")
        argv = [sys.executable, str(Path(__file__).resolve()), "flood", daemon.socket_path,
                str(connections), str(in_flight)]
        env = helpers.other_user_env() if other_user else dict(os.environ)
        flooder = subprocess.Popen(helpers.as_other_user(argv) if other_user else argv,
                                   cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert flooder.stdout is not None and flooder.stdout.readline().strip()
            wait_queued(daemon, in_flight * 3 // 4)
            started = time.monotonic()
            mine = asyncio.run(polite(daemon.socket_path, polite_in_flight, seconds))
            ended = time.monotonic()
            out, err = flooder.communicate("", timeout=60)
        finally:
            if flooder.poll() is None:
                flooder.kill()
        if flooder.returncode != 0:
            raise RuntimeError(f"the flooder failed: {err}")
        theirs = json.loads(out.splitlines()[-1])
    window = (started + 0.5, ended)  # both clients active throughout
    p = sum(window[0] <= t <= window[1] for t in mine)
    f = sum(window[0] <= t <= window[1] for t in theirs["done"])
    return {"flood_connections": connections, "flood_in_flight": in_flight,
            "flood_uid": helpers.OTHER_UID if other_user else os.geteuid(),
            "polite_uid": os.geteuid(), "polite_in_flight": polite_in_flight,
            "window_s": round(window[1] - window[0], 2), "polite_done": p, "flood_done": f,
            "polite_share": round(p / max(1, p + f), 3), "flood_errors": theirs["errors"]}


def fairness_figures(seconds: float) -> dict[str, Any]:
    cases: dict[str, Any] = {"target_polite_share": ">= 0.40 (another user's flood)"}
    cases["one_connection_same_user"] = fairness_case(1, False, seconds)
    if os.geteuid() != 0:
        cases["other_user"] = "skipped: acting as another user needs root"
        return cases
    cases["one_connection_other_user"] = fairness_case(1, True, seconds)
    cases["four_connections_other_user"] = fairness_case(4, True, seconds)
    # By design not 40 %: a user's connections share its one turn (the polite client is
    # a fifth connection of the same user here); shown so that the choice is visible.
    cases["four_connections_same_user_expected_0.2"] = fairness_case(4, False, seconds)
    # A backlog deep enough to wait out priority_aging_s (10 s) is lifted to `high`,
    # ahead of the polite client's fresh `normal` requests: ageing, not the queue.
    cases["four_connections_other_user_1000_in_flight"] = fairness_case(
        4, True, max(seconds, 20.0), in_flight=1000)
    return cases


def main(argv: list[str]) -> int:
    if argv[:1] != ["flood"] or len(argv) != 4:
        print("usage: adversarial_fairness.py flood SOCKET CONNECTIONS IN_FLIGHT",
              file=sys.stderr)
        return 2
    result = asyncio.run(flood(argv[1], int(argv[2]), int(argv[3])))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
