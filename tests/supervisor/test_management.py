"""Scale-down ticks, load/unload commands and the status listings, on fake workers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import ModelStatus
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import management
from modelpool.supervisor.workers import WorkerHandle, WorkerState

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


async def _two_idle_workers(h: Harness) -> tuple[WorkerHandle, WorkerHandle]:
    """Both emb workers ready and idle; the first served the later request, so the second
    is the least recently used. The clock then stands at the last activity."""
    sink = h.sink()
    first = h.embed(sink, ["a"])
    await h.settle()
    a, b = h.workers("emb")
    h.ready(a)
    h.ready(b)
    h.reply_embeddings(a, next(iter(a.jobs)), 1.0)
    h.want_work(a)
    h.clock.advance(5)
    second = h.embed(sink, ["b"])
    assert list(a.jobs) and not b.jobs  # the most recently used worker gets work first
    h.reply_embeddings(a, next(iter(a.jobs)), 2.0)
    h.want_work(a)
    assert {m.id for m in sink.messages} == {first, second}
    assert a.state is WorkerState.IDLE and b.state is WorkerState.IDLE
    return a, b


async def test_scale_down_stops_lru_idle_worker_once_per_cooldown(
        make_harness: MakeHarness) -> None:
    h = make_harness(cooldown_idle_s=60)
    a, b = await _two_idle_workers(h)

    h.clock.advance(59.9)
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == []

    h.clock.advance(0.1)
    management.scale_down_tick(h.pool)
    management.scale_down_tick(h.pool)  # same instant: still one per cooldown
    assert h.launcher.stopped == [b]
    await h.settle()
    assert list(h.pool.models["emb"].workers.values()) == [a]

    h.clock.advance(59.9)
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == [b]
    h.clock.advance(0.1)
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == [b, a]
    await h.settle()
    assert management.model_state(h.pool, h.pool.models["emb"]) == "cold"

    h.clock.advance(600)
    management.scale_down_tick(h.pool)
    assert len(h.launcher.stopped) == 2


async def test_no_scale_down_while_work_waits_or_runs(make_harness: MakeHarness) -> None:
    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     max_workers=1)
    h = make_harness(models=[spec], cooldown_idle_s=60)
    sink = h.sink()
    h.embed(sink, ["a"])
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    h.embed(sink, ["c"])  # waits: the one worker is busy and at its cap
    model = h.pool.models["emb"]
    assert len(model.queue) == 1

    h.clock.advance(600)
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == []

    for job_id in list(worker.jobs):
        h.reply_embeddings(worker, job_id, 1.0)
    h.want_work(worker)  # takes "c"
    assert len(model.queue) == 0 and worker.jobs
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == []

    h.reply_embeddings(worker, next(iter(worker.jobs)), 1.0)
    h.want_work(worker)
    h.clock.advance(59)  # the cooldown counts from the last completion
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == []
    h.clock.advance(1)
    management.scale_down_tick(h.pool)
    assert h.launcher.stopped == [worker]


async def test_load_model_warms_workers_up_to_the_cap_by_alias(
        make_harness: MakeHarness) -> None:
    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     aliases=["e"])
    h = make_harness(models=[spec], max_workers_per_model=3, max_concurrent_loads=2)
    message = management.load_model(h.pool, "E", 10)
    await h.settle()
    assert len(h.workers("emb")) == 2  # two load slots
    assert "keeping 3 worker" in message
    h.ready(h.workers("emb")[0])  # a slot frees: the third starts without any request
    await h.settle()
    assert len(h.workers("emb")) == 3
    management.load_model(h.pool, "emb", 2)
    await h.settle()
    assert len(h.workers("emb")) == 3  # already enough live or starting


async def test_unload_model_stops_every_worker(make_harness: MakeHarness) -> None:
    h = make_harness()
    management.load_model(h.pool, "emb", 2)
    await h.settle()
    management.unload_model(h.pool, "emb")
    assert h.launcher.stopped == h.workers("emb")
    await h.settle()
    assert h.pool.models["emb"].workers == {}


def test_management_on_an_unknown_model_is_unknown_model(make_harness: MakeHarness) -> None:
    h = make_harness()
    for command in (lambda: management.load_model(h.pool, "nope", 1),
                    lambda: management.unload_model(h.pool, "nope")):
        with pytest.raises(management.ManagementError) as raised:
            command()
        assert raised.value.code is ErrorCode.UNKNOWN_MODEL


# ---- status -------------------------------------------------------------------------


def _status(h: Harness, key: str) -> ModelStatus:
    status = management.build_status(h.pool, "/tmp/modelpool-test.sock", time.monotonic())
    (model,) = [m for m in status.models if m.key == key]
    return model


async def test_status_follows_a_model_from_cold_to_ready(make_harness: MakeHarness) -> None:
    h = make_harness()
    status = management.build_status(h.pool, "/tmp/x.sock", time.monotonic())
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


async def test_status_shows_failed_model_with_its_last_error(make_harness: MakeHarness) -> None:
    from modelpool.protocol.pipes import LoadFailed

    h = make_harness(max_load_failures=1)
    h.embed(h.sink(), ["a"])
    await h.settle()
    for worker in h.workers("emb"):
        h.pool.on_worker_message(worker, LoadFailed(cause="no weights"))
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
    info = {m.key: m for m in management.models_info(h.pool)}
    assert (info["gen"].state, info["gen"].default, info["gen"].aliases) == (
        "loading", True, ["g"])
    assert info["gen"].source == "path:/nonexistent"
    assert (info["emb"].state, info["emb"].default) == ("cold", False)
    assert info["emb"].capability == "text_embedding"


async def test_unload_while_loading_is_not_a_load_failure(make_harness: MakeHarness) -> None:
    """Workers stopped before Ready are killed (they read no Shutdown while loading);
    the next request must load at once, not wait out a load-failure back-off."""
    h = make_harness()
    h.launcher.exit_on_stop = False
    management.load_model(h.pool, "emb", 2)
    await h.settle()
    loading = h.workers("emb")
    management.unload_model(h.pool, "emb")
    for worker in loading:
        h.launcher.exit(worker, -9)
    await h.settle()
    model = h.pool.models["emb"]
    assert (model.load_failures, model.blocked_until, model.last_error) == (0, 0.0, None)
    sink = h.sink()
    h.embed(sink, ["again"])
    await h.settle()
    assert [w.state for w in model.workers.values()] == [WorkerState.LOADING] * 2


async def test_refresh_memory_measures_live_workers_and_skips_gone_ones(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    h.embed(h.sink(), ["x"])
    await h.settle()
    alive, gone = h.workers("emb")
    for worker in (alive, gone):
        h.ready(worker)
    alive.pid, gone.pid = os.getpid(), 2**22 + 1  # this process; a pid that cannot exist
    await management.refresh_memory(h.pool)
    assert alive.uss_mb is not None and alive.uss_mb > 10
    assert gone.uss_mb is None
