"""What the machine itself does to a request's tail when a CPU-bound neighbour runs at low
priority: no modelpool code, so the p99 ratios of bench_pool have a floor to be read
against.

A chain of three processes passes one message along and back, as a client, the
supervisor and a worker do: the middle one spends 0.1 ms each way, the last WORK_MS.
Windows alternate between the chain alone and the chain beside one busy loop: at
SCHED_IDLE (where the daemon cannot make an idle cgroup, loading workers run so), at
nice 19, and as a normal task in a cgroup marked cpu.idle (supervisor/cgroups.py), when
this process may make one.

And what waking a process that slept costs here: the same chain with no work at all,
its messages sent back to back against sent after the chain has slept as long as a
MiniLM forward pass takes. A lone request through the daemon crosses this chain's four
hops (client, supervisor, worker and back) after its processes slept; one in-process
call crosses none."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import percentiles

from modelpool.protocol.cgroups import move_process
from modelpool.supervisor import cgroups

WORK_MS = 5.0
NEIGHBOURS = ("alone", "sched_idle_loop", "nice_19_loop", "idle_cgroup_loop")


def _burn(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def _fork(body: Callable[[], None], close: tuple[socket.socket, ...] = ()) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            for end in close:  # or the chain would never read end-of-file
                end.close()
            body()
        finally:
            os._exit(0)
    return pid


def _relay(inbound: socket.socket, outbound: socket.socket, burn_ms: float) -> None:
    while message := inbound.recv(64):
        _burn(burn_ms)
        outbound.send(message)
        outbound.recv(64)
        _burn(burn_ms)
        inbound.send(message)


def _serve(inbound: socket.socket, work_ms: float) -> None:
    while message := inbound.recv(64):
        _burn(work_ms)
        inbound.send(message)


def _chain(relay_ms: float, work_ms: float) -> tuple[socket.socket, list[int]]:
    """The client's end of a chain of three processes, and the other two's pids."""
    client, relay_in = socket.socketpair()
    relay_out, server = socket.socketpair()
    children = [_fork(lambda: _relay(relay_in, relay_out, relay_ms), close=(client, server)),
                _fork(lambda: _serve(server, work_ms), close=(client, relay_in, relay_out))]
    for end in (relay_in, relay_out, server):
        end.close()
    return client, children


def _round_trip(client: socket.socket) -> float:
    t0 = time.perf_counter()
    client.send(b"x")
    client.recv(64)
    return time.perf_counter() - t0


def _busy_loop(neighbour: str, idle_cgroup: Path | None) -> None:
    if neighbour == "sched_idle_loop":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif neighbour == "nice_19_loop":
        os.nice(19)
    elif idle_cgroup is not None:
        move_process(str(idle_cgroup))
    while True:
        pass


def _window(client: socket.socket, seconds: float, neighbour: str,
            idle_cgroup: Path | None) -> list[float]:
    loop = (None if neighbour == "alone"
            else _fork(lambda: _busy_loop(neighbour, idle_cgroup), (client,)))
    try:
        time.sleep(0.05)
        out = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            out.append(_round_trip(client))
        return out
    finally:
        if loop is not None:
            os.kill(loop, signal.SIGKILL)
            os.waitpid(loop, 0)


def idle_neighbour(seconds: float, rounds: int) -> dict[str, Any]:
    """p99 of the chain beside each kind of busy loop, and its ratio to the chain alone."""
    client, children = _chain(0.1, WORK_MS)
    idle_cgroup = cgroups.enter(True)
    kinds = NEIGHBOURS if idle_cgroup else NEIGHBOURS[:-1]
    lat: dict[str, list[float]] = {n: [] for n in kinds}
    try:
        for _ in range(rounds):
            for neighbour in kinds:
                lat[neighbour] += _window(client, seconds / rounds / len(kinds), neighbour,
                                          idle_cgroup)
    finally:
        client.close()  # the relay, then the server, read end-of-file and exit
        for pid in children:
            os.waitpid(pid, 0)
        cgroups.leave(idle_cgroup)
    figures: dict[str, Any] = {n: percentiles(v) for n, v in lat.items()}
    alone = figures["alone"]["p99_ms"]
    figures["p99_ratio"] = {n: round(figures[n]["p99_ms"] / alone, 3) for n in kinds[1:]}
    return figures


def wakeup_after_idle(rounds: int, idle_ms: float = 8.0) -> dict[str, Any]:
    """Round trips through the chain with no work: back to back, and each after the
    chain slept idle_ms, interleaved."""
    client, children = _chain(0.0, 0.0)
    try:
        return wakeup_figures(lambda: _round_trip(client), rounds, idle_ms)
    finally:
        client.close()
        for pid in children:
            os.waitpid(pid, 0)


def wakeup_figures(round_trip: Callable[[], float], rounds: int,
                   idle_ms: float) -> dict[str, Any]:
    """round_trip()'s seconds back to back, and each after sleeping idle_ms, interleaved."""
    back_to_back, after_idle = [], []
    for _ in range(rounds):
        back_to_back.append(round_trip())
        time.sleep(idle_ms / 1000)
        after_idle.append(round_trip())
    slept = f"after_{idle_ms:g}_ms_idle"
    figures: dict[str, Any] = {"back_to_back": percentiles(back_to_back),
                               slept: percentiles(after_idle)}
    figures["p50_cost_of_waking_ms"] = round(
        figures[slept]["p50_ms"] - figures["back_to_back"]["p50_ms"], 3)
    return figures
