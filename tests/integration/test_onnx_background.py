"""A first start with no ONNX export cached: the daemon starts making the export at once,
serves MiniLM on eager PyTorch meanwhile, and then replaces its workers with ones that
run the export, answering every request throughout. A model forced to ONNX has no eager
to serve: its requests wait for the export, which is made within the memory budget."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
from conftest import FORCED_MINILM, Daemon, MakeDaemon

from modelpool.protocol.client import Client, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.registry.download import resolve_model_dir
from modelpool.registry.loaders import onnx_cache, weights_size_mb
from modelpool.registry.spec import ModelSpec, Registry, load_catalog

HoldExport = Callable[..., AbstractContextManager[None]]  # (cache, *, found_made=False)
TEXTS = ["a worker serves many clients", "short", "the quick brown fox " * 40]
# torch's import and MiniLM's export at idle priority on 2 busy cores: the client's bound
# and the request's own (the daemon's default, [pool] timeout_s, is 30 s)
EXPORT_BOUND_S = 300
# Requests keep coming while MiniLM's export runs, this far apart: back to back (0.05 s),
# its eager workers kept the cores and the export, at idle priority, took ~20 s longer.
BETWEEN_REQUESTS_S = 0.25
FORCED_ONNX = "[pool]\ncold_start_workers = 1\n{pool}\n" + FORCED_MINILM + "default = true\n"


def _minilm(c: Client) -> dict:
    return next(m for m in c.status()["models"] if m["key"].endswith("MiniLM-L6-v2"))


def _workers(c: Client) -> list[dict]:
    return _minilm(c)["workers"]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _idle_soon(pid: int) -> bool:
    """The process runs at SCHED_IDLE within a second: the supervisor sets it as soon as
    the process is started, which a test polling for it may see first."""
    deadline = time.monotonic() + 1
    while os.sched_getscheduler(pid) != os.SCHED_IDLE and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.sched_getscheduler(pid) == os.SCHED_IDLE


def _export_process(daemon: Daemon) -> list[int]:
    return [p.pid for p in daemon.running("onnx_export")]


def test_the_export_is_made_from_the_start_while_eager_serves_then_workers_are_replaced(
        make_daemon: MakeDaemon, tmp_path: Path, hold_minilm_export: HoldExport) -> None:
    cache = tmp_path / "empty-cache"
    with hold_minilm_export(cache):
        daemon = make_daemon("[pool]\ncold_start_workers = 2\n",
                             env={"MODELPOOL_CACHE_DIR": str(cache)})
        deadline = time.monotonic() + 30
        while not _export_process(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        (export,) = _export_process(daemon)  # before any request: one, at idle priority
        assert _idle_soon(export)
        # forked from the forkserver, which has torch imported, not a fresh interpreter
        assert "forkserver" in " ".join(psutil.Process(export).parent().cmdline())
        with daemon.client(timeout_s=120) as c:
            first = np.asarray(c.embed(TEXTS))
            infos = [w["info"] for w in _workers(c) if w["info"]]
        assert infos and all(i["execution"] == "eager" for i in infos)
        assert all("background" in i["execution_reason"] for i in infos)
    # The lock is free: the export goes on, requests keep coming while workers change.
    with daemon.client(timeout_s=120) as c:
        answered, deadline = 0, time.monotonic() + EXPORT_BOUND_S
        while time.monotonic() < deadline:
            got = np.asarray(c.embed(TEXTS))
            assert got.shape == (3, 384) and _cosines(got, first).min() >= 0.9999
            answered += 1
            workers = _workers(c)
            if workers and all(w["info"].get("execution") == "onnx" for w in workers):
                break
            time.sleep(BETWEEN_REQUESTS_S)
        else:
            raise AssertionError(f"still not all ONNX: {_workers(c)}\n{daemon.log()}")
    assert answered > 1 and len(workers) == 2
    manifests = list((cache / "onnx").glob("*/manifest.json"))
    assert len(manifests) == 1
    assert msgspec.json.decode(manifests[0].read_bytes())["choice"] == "onnx"
    log = daemon.log()
    assert log.count("making its ONNX export in the background") == 1
    assert log.count("a new worker serves better") == 2


def test_an_export_that_does_not_fit_the_memory_budget_waits_and_eager_serves(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    # MiniLM's export is expected to peak at ~990 MiB (onnx_cache.export_peak_mb): more
    # than this whole budget, so it never starts; the model serves eager PyTorch.
    cache = tmp_path / "empty-cache"
    daemon = make_daemon("[pool]\ncold_start_workers = 1\nmemory_budget_mb = 700\n",
                         env={"MODELPOOL_CACHE_DIR": str(cache)})
    with daemon.client(timeout_s=120) as c:
        assert np.asarray(c.embed(TEXTS)).shape == (3, 384)
        model = _minilm(c)
    spec = Registry(load_catalog()).resolve("minilm")
    assert spec is not None
    weights = weights_size_mb(resolve_model_dir(spec))
    assert weights is not None
    assert model["export_waits_for_mb"] == pytest.approx(onnx_cache.export_peak_mb(weights))
    assert [w["info"]["execution"] for w in model["workers"]] == ["eager"]
    assert _export_process(daemon) == [] and not list(cache.glob("onnx/*/manifest.json"))
    assert "its ONNX export waits for memory" in daemon.log()


def test_a_model_forced_to_onnx_waits_for_the_export_made_within_the_budget(
        make_daemon: MakeDaemon, tmp_path: Path, hold_minilm_export: HoldExport) -> None:
    cache = tmp_path / "empty-cache"
    answers: list[np.ndarray] = []
    with hold_minilm_export(cache, found_made=True):
        daemon = make_daemon(FORCED_ONNX.format(pool=""), env={"MODELPOOL_CACHE_DIR": str(cache)})

        def embed() -> None:
            with daemon.client(timeout_s=EXPORT_BOUND_S) as c:
                answers.append(np.asarray(c.embed(TEXTS, timeout_s=EXPORT_BOUND_S)))

        asking = threading.Thread(target=embed)
        asking.start()
        with daemon.client() as c:
            deadline = time.monotonic() + 30
            while ((not _minilm(c)["queued"] or not _export_process(daemon))
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            model = _minilm(c)
        # No worker exports in its load, uncharged: the daemon's export comes first.
        assert model["state"] == "exporting" and model["workers"] == [], model
        assert len(_export_process(daemon)) == 1
    asking.join(EXPORT_BOUND_S)
    assert len(answers) == 1 and answers[0].shape == (3, 384)
    with daemon.client() as c:
        assert [w["info"]["execution"] for w in _workers(c)] == ["onnx"]
    assert daemon.log().count("making its ONNX export in the background") == 1


def test_a_model_forced_to_onnx_whose_export_never_fits_is_refused(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    daemon = make_daemon(FORCED_ONNX.format(pool="memory_budget_mb = 700"),
                         env={"MODELPOOL_CACHE_DIR": str(cache)})
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed(TEXTS)
    assert err.value.code is ErrorCode.INSUFFICIENT_MEMORY and "ONNX" in err.value.message
    assert _export_process(daemon) == [] and not list(cache.glob("onnx/*/manifest.json"))


def test_a_forced_hub_model_downloaded_after_the_start_has_its_export_made_by_the_daemon(
        make_daemon: MakeDaemon, tmp_path: Path,
        put_minilm_in_hub_cache: Callable[[Path], None]) -> None:
    cache, hub = tmp_path / "empty-cache", tmp_path / "hub"
    daemon = make_daemon("""
        [pool]
        cold_start_workers = 1
        [[models]]
        key = "org/minilm"
        capability = "text_embedding"
        repo = "org/minilm"
        execution = "onnx"
        """, env={"MODELPOOL_CACHE_DIR": str(cache), "HF_HUB_CACHE": str(hub)})
    # Its files come after the start, as if its first worker had downloaded them: that
    # worker finds no export and leaves it to the daemon instead of making it in its own
    # load, uncharged.
    put_minilm_in_hub_cache(hub)
    with daemon.client(timeout_s=EXPORT_BOUND_S) as c:
        embedded = c.embed(TEXTS, model="org/minilm", timeout_s=EXPORT_BOUND_S)
        assert np.asarray(embedded).shape == (3, 384)
        (model,) = [m for m in c.status()["models"] if m["key"] == "org/minilm"]
    assert [w["info"]["execution"] for w in model["workers"]] == ["onnx"]
    log = daemon.log()
    assert "its worker leaves the ONNX export to the daemon" in log
    assert log.count("making its ONNX export in the background") == 1
    assert "failed to load" not in log


def test_a_running_export_stops_when_a_worker_start_needs_its_memory(
        make_daemon: MakeDaemon, tmp_path: Path, hold_minilm_export: HoldExport) -> None:
    # MiniLM's export is expected to peak at ~990 MiB: it fits this budget alone, but
    # the first request's two workers (charged 90 MiB of weights and 120 each until they
    # are measured) do not fit beside it.
    cache = tmp_path / "empty-cache"
    with hold_minilm_export(cache):  # the export waits: it cannot end meanwhile
        daemon = make_daemon("[pool]\ncold_start_workers = 2\nmemory_budget_mb = 1250\n",
                             env={"MODELPOOL_CACHE_DIR": str(cache)})
        deadline = time.monotonic() + 30
        while not _export_process(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        (pid,) = _export_process(daemon)
        export = psutil.Process(pid)
        with daemon.client(timeout_s=120) as c:
            assert _minilm(c)["exporting"] and _workers(c) == []  # before any worker
            assert np.asarray(c.embed(TEXTS)).shape == (3, 384)
            assert len(_workers(c)) == 2
        export.wait(30)  # killed: serving comes first
    log = daemon.log()
    assert "its ONNX export stops to leave its memory to a worker" in log


def test_a_rerank_model_serves_eager_while_its_export_is_made_then_runs_it(
        make_daemon: MakeDaemon, tmp_path: Path, tiny_models_dir: Path) -> None:
    model_dir = tiny_models_dir / "tiny-rerank"
    spec = ModelSpec(key="tiny-rerank", capability="rerank", path=str(model_dir))
    minilm = Registry(load_catalog()).resolve("minilm")
    assert minilm is not None
    minilm_dir = resolve_model_dir(minilm)
    assert minilm_dir is not None
    made = onnx_cache.entry_dir(minilm, minilm_dir)  # in the run's cache
    cache = tmp_path / "cache"
    (cache / "onnx").mkdir(parents=True)
    (cache / "onnx" / made.name).symlink_to(made)  # only tiny-rerank's is to make
    entry = cache / "onnx" / onnx_cache.entry_key(spec, model_dir)
    daemon = make_daemon(f"""
        [pool]
        cold_start_workers = 1
        [[models]]
        key = "tiny-rerank"
        capability = "rerank"
        path = "{model_dir}"
        """, env={"MODELPOOL_CACHE_DIR": str(cache)})
    query, docs = "what does a worker do", ["a worker runs a model", "bananas", "x " * 300]
    with open(f"{entry}.lock", "w") as lock:  # the export waits behind it
        fcntl.flock(lock, fcntl.LOCK_EX)
        with daemon.client(timeout_s=120) as c:
            first = c.rerank(query, docs)
            (model,) = [m for m in c.status()["models"] if m["key"] == "tiny-rerank"]
        assert [w["info"]["execution"] for w in model["workers"]] == ["eager"]
        assert "background" in model["workers"][0]["info"]["execution_reason"]
    with daemon.client(timeout_s=120) as c:
        deadline = time.monotonic() + EXPORT_BOUND_S
        while time.monotonic() < deadline:
            np.testing.assert_allclose(c.rerank(query, docs), first, rtol=1e-5, atol=1e-5)
            (model,) = [m for m in c.status()["models"] if m["key"] == "tiny-rerank"]
            if [w["info"].get("execution") for w in model["workers"]] == ["onnx"]:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"still not ONNX: {model}\n{daemon.log()}")
    manifest = onnx_cache.read_manifest(entry)
    assert manifest is not None and manifest.choice == "onnx" and manifest.checked
    assert daemon.log().count("making its ONNX export in the background") == 1
