"""A first start with no ONNX export cached: the daemon serves MiniLM on eager PyTorch
at once, makes the export in the background, and replaces its workers with ones that
run it, answering every request throughout."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from conftest import Daemon

from modelpool.protocol.client import Client

MakeDaemon = Callable[..., Daemon]
TEXTS = ["a worker serves many clients", "short", "the quick brown fox " * 40]
EXPORT_BOUND_S = 300  # torch's import and MiniLM's export at idle priority on 2 busy cores


def _workers(c: Client) -> list[dict]:
    return next(m for m in c.status()["models"] if m["key"].endswith("MiniLM-L6-v2")
                )["workers"]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_the_first_request_is_served_eager_while_the_export_is_made_then_onnx(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    daemon = make_daemon("[pool]\ncold_start_workers = 2\n",
                         env={"MODELPOOL_CACHE_DIR": str(cache)})
    with daemon.client(timeout_s=120) as c:
        first = np.asarray(c.embed(TEXTS))
        infos = [w["info"] for w in _workers(c) if w["info"]]
        assert infos and all(i["execution"] == "eager" for i in infos)
        assert all("background" in i["execution_reason"] for i in infos)
        exports = [p for p in daemon.descendants() if "onnx_export" in " ".join(p.cmdline())]
        assert len(exports) == 1  # one for both workers, at idle priority
        assert os.sched_getscheduler(exports[0].pid) == os.SCHED_IDLE

        # Requests keep coming while the export runs and the workers are replaced.
        answered, deadline = 0, time.monotonic() + EXPORT_BOUND_S
        while time.monotonic() < deadline:
            got = np.asarray(c.embed(TEXTS))
            assert got.shape == (3, 384) and _cosines(got, first).min() >= 0.9999
            answered += 1
            workers = _workers(c)
            if workers and all(w["info"].get("execution") == "onnx" for w in workers):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"still not all ONNX: {_workers(c)}\n{daemon.log()}")
    assert answered > 1 and len(workers) == 2
    assert (cache / "onnx").is_dir()
    log = daemon.log()
    assert "making its ONNX export in the background" in log
    assert log.count("a new worker serves better") == 2
