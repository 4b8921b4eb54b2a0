"""The bundled MiniLM through a real daemon runs its verified ONNX export (no torch in
its workers), and gives eager PyTorch's vectors."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import psutil
from conftest import MakeDaemon

from modelpool.registry.loaders import load_model
from modelpool.registry.spec import Registry, load_catalog

TEXTS = ["a worker serves many clients", "short", "the quick brown fox " * 40]


def test_minilm_serves_from_its_onnx_export_with_eager_vectors(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 2\n")
    with daemon.client() as c:  # the export is cached (tests/conftest.py)
        got = np.asarray(c.embed(TEXTS))
        workers = next(m for m in c.status()["models"] if m["key"].endswith("MiniLM-L6-v2")
                       )["workers"]
    ready = [w for w in workers if w["info"]]
    assert ready and all(w["info"]["execution"] == "onnx" for w in ready)
    spec = Registry(load_catalog()).resolve("minilm")
    assert spec is not None
    eager = load_model(msgspec.structs.replace(spec, execution="eager")).embed(TEXTS)
    cosines = (got * eager).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(
        eager, axis=1)
    assert got.shape == (3, 384) and cosines.min() >= 0.9999


def test_with_the_export_cached_no_process_of_the_daemon_maps_torch(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\ncold_start_workers = 2\n")
    with daemon.client() as c:
        c.embed(TEXTS)
    processes = daemon.descendants()
    assert len(processes) >= 3  # the forkserver and two workers (and a resource tracker)
    for process in [psutil.Process(daemon.process.pid), *processes]:
        maps = {m.path for m in process.memory_maps()}
        assert not any("libtorch" in path for path in maps), process.cmdline()


HUB_MINILM = """
[pool]
cold_start_workers = 1
[[models]]
key = "org/minilm"
capability = "text_embedding"
repo = "org/minilm"
"""


def test_a_hub_model_in_the_hub_cache_runs_its_cached_export_without_torch_too(
        make_daemon: MakeDaemon, minilm_in_hub_cache: Path) -> None:
    # The same files as the bundled MiniLM, whose export the run has cached.
    daemon = make_daemon(HUB_MINILM, env={"HF_HUB_CACHE": str(minilm_in_hub_cache)})
    with daemon.client() as c:
        assert np.asarray(c.embed(TEXTS, model="org/minilm")).shape == (3, 384)
        (model,) = [m for m in c.status()["models"] if m["key"] == "org/minilm"]
    assert [w["info"]["execution"] for w in model["workers"]] == ["onnx"]
    for process in [psutil.Process(daemon.process.pid), *daemon.descendants()]:
        maps = {m.path for m in process.memory_maps()}
        assert not any("libtorch" in path for path in maps), process.cmdline()
