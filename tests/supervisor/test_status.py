"""`modelpool status` and `models`, and re-measuring workers' memory, on fake workers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import pytest

from modelpool.protocol.status import ModelStatus
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.status import build_status, models_info, refresh_memory

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


# ---- status -------------------------------------------------------------------------


def _status(h: Harness, key: str) -> ModelStatus:
    status = build_status(h.pool, "/tmp/modelpool-test.sock", time.monotonic())
    (model,) = [m for m in status.models if m.key == key]
    return model


async def test_status_follows_a_model_from_cold_to_ready(make_harness: MakeHarness) -> None:
    h = make_harness()
    status = build_status(h.pool, "/tmp/x.sock", time.monotonic())
    assert status.socket == "/tmp/x.sock" and status.shutting_down is False
    assert {"emb", "gen"} <= {m.key for m in status.models}
    assert _status(h, "emb").state == "cold" and _status(h, "emb").workers == []

    sink = h.sink()
    h.embed(sink, ["a"])
    h.embed(sink, ["b"], priority="low")
    await h.settle()
    emb = _status(h, "emb")
    assert (emb.state, emb.queued, emb.running) == ("loading", 2, 0)
    assert [(w.state, w.inflight) for w in emb.workers] == [("loading", 0)] * 2
    assert [w.pid for w in emb.workers] == [w.pid for w in h.workers("emb")]

    a = h.workers("emb")[0]
    h.ready(a)
    emb = _status(h, "emb")
    assert (emb.state, emb.queued, emb.running) == ("ready", 0, 2)
    assert emb.capability == "text_embedding"
    by_pid = {w.pid: w for w in emb.workers}
    assert (by_pid[a.pid].state, by_pid[a.pid].inflight) == ("busy", 2)
    assert by_pid[a.pid].idle_s is None
    assert _status(h, "gen").state == "cold"

    for job_id in list(a.jobs):
        h.reply_embeddings(a, job_id, 1.0)
    h.want_work(a)
    h.clock.advance(7)
    emb = _status(h, "emb")
    assert (emb.running, emb.completed, emb.failed) == (0, 2, 0)
    by_pid = {w.pid: w for w in emb.workers}
    assert (by_pid[a.pid].state, by_pid[a.pid].idle_s) == ("idle", 7.0)


async def test_status_text_shows_the_threads_each_worker_last_reported(
        make_harness: MakeHarness) -> None:
    from modelpool.protocol.pipes import Heartbeat
    from modelpool.supervisor.cli import _worker_text

    h = make_harness(cold_start_workers=2)
    h.embed(h.sink(), ["a"])
    await h.settle()
    first, second = h.workers("emb")
    for worker in (first, second):
        h.ready(worker)
    h.pool.handle_heartbeat(first, Heartbeat(seq=0, progress=1, threads=2))
    h.pool.handle_heartbeat(second, Heartbeat(seq=0, progress=1, threads=1))
    # As the CLI gets it: the status as plain data, over the socket.
    status = msgspec.to_builtins(build_status(h.pool, "/s", time.monotonic()))
    (emb,) = [m for m in status["models"] if m["key"] == "emb"]
    texts = {w["pid"]: _worker_text(w) for w in emb["workers"]}
    assert texts[first.pid].endswith(" 2 threads")
    assert texts[second.pid].endswith(" 1 thread")


async def test_status_shows_failed_model_with_its_last_error(make_harness: MakeHarness) -> None:
    from modelpool.protocol.pipes import LoadFailed

    h = make_harness(max_load_failures=1)
    h.embed(h.sink(), ["a"])
    await h.settle()
    for worker in h.workers("emb"):
        h.pool.handle(worker, LoadFailed(cause="no weights"))
        h.die(worker, 3)
    emb = _status(h, "emb")
    assert emb.state == "failed" and emb.failed == 1
    assert emb.last_error is not None and "no weights" in emb.last_error


async def test_models_info_lists_keys_defaults_aliases_and_states(
        make_harness: MakeHarness) -> None:
    models = [
        ModelSpec(key="emb", capability="text_embedding", path="/nonexistent"),
        ModelSpec(key="gen", capability="text_to_text", path="/nonexistent",
                  aliases=["g"], default=True),
    ]
    h = make_harness(models=models)
    h.generate(h.sink(), model="g")
    await h.settle()
    info = {m.key: m for m in models_info(h.pool)}
    assert (info["gen"].state, info["gen"].default, info["gen"].aliases) == (
        "loading", True, ["g"])
    assert info["gen"].source == "path:/nonexistent"
    assert (info["emb"].state, info["emb"].default) == ("cold", False)
    assert info["emb"].capability == "text_embedding"


async def test_models_info_gives_the_context_a_loaded_worker_reports(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[ModelSpec(key="gen", capability="text_to_text", path="/none")])
    h.generate(h.sink(), model="gen")
    await h.settle()

    def context() -> int | None:
        return next(m.context for m in models_info(h.pool) if m.key == "gen")

    assert context() is None  # loading: not known yet
    h.ready(h.workers("gen")[0], info={"context": 512, "chat_template": True})
    assert context() == 512


async def test_refresh_memory_measures_live_workers_and_skips_gone_ones(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    h.embed(h.sink(), ["x"])
    await h.settle()
    alive, gone = h.workers("emb")
    for worker in (alive, gone):
        h.ready(worker)
    alive.pid, gone.pid = os.getpid(), 2**22 + 1  # this process; a pid that cannot exist
    await refresh_memory(h.pool)
    assert alive.uss_mb is not None and alive.uss_mb > 10
    assert gone.uss_mb is None


async def test_a_loading_hub_model_shows_its_download_then_its_weights(
        make_harness: MakeHarness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    h = make_harness(models=[ModelSpec(key="hub", capability="text_embedding", repo="org/x")])
    assert _status(h, "hub").loading is None
    h.embed(h.sink(), ["a"], model="hub")
    await h.settle()
    blobs = tmp_path / "models--org--x" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc.incomplete").write_bytes(b"x" * 3 * 2**20)
    assert _status(h, "hub").loading == "downloading: 3.0 MiB in the cache so far"
    (blobs / "abc.incomplete").rename(blobs / "abc")
    (tmp_path / "models--org--x" / "refs").mkdir()
    (tmp_path / "models--org--x" / "refs" / "main").write_text("d" * 40)
    (tmp_path / "models--org--x" / "snapshots" / ("d" * 40)).mkdir(parents=True)
    assert _status(h, "hub").loading == "loading weights"
