"""Background ONNX exports: made once while eager workers serve, then those workers are
replaced one at a time; an export that loses leaves them serving, with the reason. A model
forced to ONNX starts no worker until its export is made."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from modelpool.protocol.messages import ErrorCode
from modelpool.protocol.pipes import ExportFirst
from modelpool.registry.loaders import onnx_cache
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import control
from modelpool.supervisor.cli import _model_text
from modelpool.supervisor.exports import ONNX, REPLACED_BECAUSE
from modelpool.supervisor.status import build_status
from modelpool.supervisor.workers import WorkerState

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]
PENDING = {"dim": 2, "execution": "eager", "execution_reason": "no ONNX export yet",
           "onnx_export": {"entry": "/cache/onnx/abc", "model_dir": "/models/emb"}}


class FakeExport:
    """Stands in for the export's process: records each run, ends when told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Path, Path]] = []
        self.outcome: asyncio.Future[str] | None = None

    async def __call__(self, spec: ModelSpec, model_dir: Path, entry: Path) -> str:
        self.calls.append((spec.key, model_dir, entry))
        self.outcome = asyncio.get_running_loop().create_future()
        return await self.outcome

    def end(self, outcome: str) -> None:
        """The running export ends: ONNX, or why the model stays eager."""
        assert self.outcome is not None
        self.outcome.set_result(outcome)


async def _two_eager_workers(make_harness: MakeHarness,
                             **pool: float) -> tuple[Harness, FakeExport]:
    h = make_harness(cold_start_workers=2, **pool)
    export = FakeExport()
    h.pool.exports.run = export
    sink = h.sink()
    h.embed(sink, ["a"])
    await h.settle()
    for worker in h.workers("emb"):
        h.ready(worker, info=dict(PENDING))
    await h.settle()
    return h, export


async def test_one_export_for_the_workers_that_name_it_then_each_is_replaced(
        make_harness: MakeHarness) -> None:
    h, export = await _two_eager_workers(make_harness)
    first, second = h.workers("emb")
    assert export.calls == [("emb", Path("/models/emb"), Path("/cache/onnx/abc"))]
    h.pool.tick()
    assert h.launcher.stopped == []  # nothing is replaced before the export is done

    export.end(ONNX)
    await h.settle()
    assert first.outdated == second.outdated == REPLACED_BECAUSE
    h.pool.tick()
    await h.settle()
    stopped = h.launcher.stopped
    assert len(stopped) == 1 and stopped[0] in (first, second)
    (new,) = h.workers("emb")[2:]
    assert new.state is WorkerState.LOADING
    h.pool.tick()  # one at a time: the new one is still loading
    assert len(h.launcher.stopped) == 1

    h.ready(new, info={"dim": 2, "execution": "onnx"})
    h.pool.tick()
    await h.settle()
    assert {*h.launcher.stopped} == {first, second}
    h.ready(h.workers("emb")[3], info={"dim": 2, "execution": "onnx"})
    h.pool.tick()
    assert len(h.launcher.stopped) == 2 and len(h.workers("emb")) == 4
    assert export.calls == [("emb", Path("/models/emb"), Path("/cache/onnx/abc"))]


async def test_an_export_that_loses_leaves_the_workers_serving_and_says_why(
        make_harness: MakeHarness) -> None:
    h, export = await _two_eager_workers(make_harness)
    export.end("timing set in 90 ms against eager PyTorch's 60")
    await h.settle()
    for worker in h.workers("emb"):
        assert worker.outdated is None and "onnx_export" not in worker.info
        assert worker.info["execution_reason"].startswith("timing set in 90 ms")
    h.pool.tick()
    assert h.launcher.stopped == []
    # A later worker naming the same export is told at once; nothing is exported again.
    late = h.pool.start_worker(h.pool.models["emb"])
    await h.settle()
    h.ready(late, info=dict(PENDING))
    assert late.info["execution_reason"].startswith("timing set in 90 ms")
    assert len(export.calls) == 1


async def test_a_failed_export_is_not_retried_and_stopping_kills_a_running_one(
        make_harness: MakeHarness) -> None:
    h, export = await _two_eager_workers(make_harness)
    assert export.outcome is not None
    export.outcome.set_exception(OSError("no space left on device"))
    await h.settle()
    for worker in h.workers("emb"):
        assert "no space left on device" in worker.info["execution_reason"]

    h2, export2 = await _two_eager_workers(make_harness)
    _, running = next(iter(h2.pool.exports.running.values()))
    await h2.pool.exports.close()
    assert running.cancelled() and h2.pool.exports.running == {}
    late = h2.pool.start_worker(h2.pool.models["emb"])
    await h2.settle()
    h2.ready(late, info=dict(PENDING))
    assert len(export2.calls) == 1  # none after close


async def test_exports_of_two_models_run_one_after_the_other(
        make_harness: MakeHarness) -> None:
    h, export = await _two_eager_workers(make_harness)
    h.generate(h.sink(), "hi")
    await h.settle()
    other = {**PENDING, "onnx_export": {"entry": "/cache/onnx/def", "model_dir": "/models/g"}}
    for worker in h.workers("gen"):
        h.ready(worker, info=other)
    await h.settle()
    assert [call[0] for call in export.calls] == ["emb"]  # the second waits its turn
    export.end(ONNX)
    await h.settle()
    assert [call[0] for call in export.calls] == ["emb", "gen"]


async def test_two_models_that_share_an_export_wait_for_one_and_both_are_replaced(
        make_harness: MakeHarness) -> None:
    h, export = await _two_eager_workers(make_harness)
    h.generate(h.sink(), "hi")
    await h.settle()
    for worker in h.workers("gen"):
        h.ready(worker, info=dict(PENDING))  # the same files and options: the same entry
    export.end(ONNX)
    await h.settle()
    assert len(export.calls) == 1
    assert all(w.outdated for w in h.workers("emb") + h.workers("gen"))


def _status_text(h: Harness, key: str) -> str:
    status = msgspec.to_builtins(build_status(h.pool, "/s", 0.0))
    return "\n".join(_model_text(next(m for m in status["models"] if m["key"] == key)))


async def test_status_says_while_eager_serves_for_an_export(make_harness: MakeHarness) -> None:
    h, export = await _two_eager_workers(make_harness)
    assert "ONNX export made in the background" in _status_text(h, "emb")
    export.end("the ONNX export exited with 1: MemoryError")
    await h.settle()
    assert "ONNX export" not in _status_text(h, "emb")


async def test_status_says_while_an_export_made_at_the_start_runs_before_any_worker(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    export = FakeExport()
    h.pool.exports.run = export
    h.pool.exports.request(h.pool.models["emb"], "/cache/onnx/abc", "/models/emb")
    await h.settle()
    status = msgspec.to_builtins(build_status(h.pool, "/s", 0.0))
    (emb,) = [m for m in status["models"] if m["key"] == "emb"]
    assert emb["exporting"] and emb["state"] == "cold" and emb["workers"] == []
    assert "ONNX export made in the background" in _status_text(h, "emb")
    export.end(ONNX)
    await h.settle()
    assert "ONNX export" not in _status_text(h, "emb")


async def test_an_export_waits_for_room_in_the_budget_and_is_charged_while_it_runs(
        make_harness: MakeHarness) -> None:
    # Two workers of 10 MiB weights and 10 each hold 30; the export's peak (for 10 MiB
    # of weights) does not fit in what the budget leaves.
    peak = onnx_cache.export_peak_mb(10)
    h, export = await _two_eager_workers(make_harness, memory_budget_mb=30 + peak - 10)
    models = h.pool.models.values()
    used = h.pool.capacity.used_mb(models)
    assert used == 30 and export.calls == []
    assert h.pool.exports.waits_for_memory(h.pool.models["emb"]) == peak
    assert f"ONNX export waits for ~{peak:.0f} MiB" in _status_text(h, "emb")
    h.pool.tick()
    assert export.calls == []

    h.pool.capacity.budget_mb = 30 + peak + 10  # memory other processes held came back
    h.pool.tick()
    await h.settle()
    assert len(export.calls) == 1 and h.pool.exports.waits_for_memory(
        h.pool.models["emb"]) is None
    # Charged (the daemon does not take the export's memory for outside pressure), but
    # the policy plans as if it were free: it yields it to a worker.
    assert h.pool.capacity.used_mb(models) == used + peak
    assert h.pool.capacity.view(models).used_mb["cpu"] == used
    assert "ONNX export made in the background" in _status_text(h, "emb")
    export.end(ONNX)
    await h.settle()
    assert h.pool.capacity.used_mb(models) == used


async def test_an_export_waiting_for_a_model_a_reload_removes_is_not_made(
        make_harness: MakeHarness) -> None:
    from modelpool.supervisor.reload import apply_reload, plan_reload

    peak = onnx_cache.export_peak_mb(10)
    h, export = await _two_eager_workers(make_harness, memory_budget_mb=30 + peak - 10)
    assert h.pool.exports.waits_for_memory(h.pool.models["emb"]) == peak
    new = msgspec.structs.replace(h.pool.config, models=[
        m for m in h.pool.config.models if m.key != "emb"])
    apply_reload(h.pool, plan_reload(h.pool.registry.specs, new.registry().specs,
                                     h.pool.config, new), new)
    h.pool.capacity.budget_mb = 30 + peak + 10  # room: it would start now
    h.pool.tick()
    await h.settle()
    assert export.calls == [] and h.pool.exports.view().waiting == ()


async def test_a_worker_that_needs_the_exports_memory_stops_it_until_there_is_room(
        make_harness: MakeHarness) -> None:
    peak = onnx_cache.export_peak_mb(10)
    h, export = await _two_eager_workers(make_harness, memory_budget_mb=30 + peak + 28)
    assert len(export.calls) == 1 and h.pool.exports.charged_mb == peak  # 28 MiB left
    _, task = next(iter(h.pool.exports.running.values()))
    # Two workers of another model start at its first request (20 MiB, then 10): the
    # second does not fit beside the export, so the export makes room.
    h.generate(h.sink(), "hi")
    await h.settle()
    assert len(h.workers("gen")) == 2 and task.cancelled()
    assert h.pool.exports.running == {} and h.pool.exports.charged_mb == 0
    assert h.pool.exports.waits_for_memory(h.pool.models["emb"]) == peak
    h.pool.tick()  # 2 MiB short of the export's peak: still no room
    assert len(export.calls) == 1

    h.pool.capacity.budget_mb = 30 + peak + 100
    h.pool.tick()
    await h.settle()
    assert len(export.calls) == 2 and h.pool.exports.charged_mb == peak
    export.end(ONNX)
    await h.settle()
    assert all(w.outdated for w in h.workers("emb"))


def _forced_onnx(make_harness: MakeHarness, at_start: bool = True,
                 **pool: float) -> tuple[Harness, FakeExport]:
    """A daemon whose "emb" must run ONNX and has no export cached. at_start: its files
    are here, and it asks for the export at its start, as the server does."""
    models = [ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                        weights_mb=10, per_worker_mb=10, execution="onnx")]
    h = make_harness(models=models, cold_start_workers=2, **pool)
    export = FakeExport()
    h.pool.exports.run = export
    if at_start:
        h.pool.exports.request(h.pool.models["emb"], "/cache/onnx/abc", "/models/emb")
    return h, export


async def _ended(h: Harness, export: FakeExport, outcome: str) -> None:
    """The running export ends, and the pool's next tick acts on it."""
    export.end(outcome)
    await h.settle()
    h.pool.tick()
    await h.settle()


async def test_a_model_forced_to_onnx_starts_its_workers_once_its_export_is_made(
        make_harness: MakeHarness) -> None:
    h, export = _forced_onnx(make_harness)
    await h.settle()
    sink = h.sink()
    client_id = h.embed(sink, ["a"])
    h.pool.tick()
    await h.settle()
    # It cannot serve eager PyTorch meanwhile, and a worker exporting in its load would
    # take the export's memory uncharged: no worker until the export is made.
    assert len(export.calls) == 1 and h.workers("emb") == []
    assert sink.finals(client_id) == []
    text = _status_text(h, "emb")
    assert " exporting " in text and "its workers start once it is made" in text
    assert "ONNX export made in the background" in text
    assert "ONNX export" in h.pool.models["emb"].wait_cause(
        next(iter(h.pool.models["emb"].queue.jobs())))
    await _ended(h, export, ONNX)
    assert len(h.workers("emb")) == 2 and h.pool.models["emb"].awaits_export_mb is None
    h.ready(h.workers("emb")[0], info={"dim": 2, "execution": "onnx"})
    (work,) = h.works(h.workers("emb")[0])
    h.reply_embeddings(h.workers("emb")[0], work.items[0].job_id, 1.0, 2.0)
    assert len(sink.finals(client_id)) == 1 and sink.errors() == []


async def test_a_forced_models_export_that_fails_lets_its_workers_try_in_their_load(
        make_harness: MakeHarness) -> None:
    h, export = _forced_onnx(make_harness)
    await h.settle()
    h.embed(h.sink(), ["a"])
    h.pool.tick()
    await h.settle()
    assert h.workers("emb") == []
    await _ended(h, export, "the ONNX export exited with -9: ")
    assert len(h.workers("emb")) == 2


async def test_a_forced_models_export_that_fits_is_made_and_one_that_never_fits_is_refused(
        make_harness: MakeHarness) -> None:
    peak = onnx_cache.export_peak_mb(10)
    h, export = _forced_onnx(make_harness, memory_budget_mb=peak + 10)
    sink = h.sink()
    h.embed(sink, ["a"])
    h.pool.tick()
    await h.settle()
    assert len(export.calls) == 1 and h.workers("emb") == []  # it fits the budget: queued
    assert sink.errors() == []

    small, small_export = _forced_onnx(make_harness, memory_budget_mb=peak - 1)
    small_sink = small.sink()
    client_id = small.embed(small_sink, ["a"])
    error = small_sink.only_error(client_id)
    assert error.code is ErrorCode.INSUFFICIENT_MEMORY and "ONNX" in error.message
    assert f"{peak:.0f} MiB" in error.message
    assert small_export.calls == [] and small.workers("emb") == []
    assert f"ONNX export waits for ~{peak:.0f} MiB" in _status_text(small, "emb")


async def test_a_forced_model_kept_warm_starts_its_workers_once_its_export_is_made(
        make_harness: MakeHarness) -> None:
    h, export = _forced_onnx(make_harness)
    await h.settle()
    message = control.load_model(h.pool, "emb", 1)
    await h.settle()
    assert "once its ONNX export is made" in message and h.workers("emb") == []
    await _ended(h, export, ONNX)
    assert len(h.workers("emb")) == 1


async def test_a_worker_that_finds_no_export_leaves_it_to_the_daemon_and_exits_unblamed(
        make_harness: MakeHarness) -> None:
    # A model forced to ONNX whose files were not here at the start (a hub model that
    # its first worker downloads): that worker finds no export and hands it over.
    h, export = _forced_onnx(make_harness, at_start=False)
    sink = h.sink()
    client_id = h.embed(sink, ["a"])
    await h.settle()
    first, second = h.workers("emb")
    for worker in (first, second):
        h.pool.handle(worker, ExportFirst(entry="/cache/onnx/abc", model_dir="/models/emb"))
        h.die(worker, 0)
    h.pool.tick()
    await h.settle()
    model = h.pool.models["emb"]
    assert export.calls == [("emb", Path("/models/emb"), Path("/cache/onnx/abc"))]
    assert len(h.workers("emb")) == 2 and model.failures.count == model.deaths.count == 0
    assert sink.finals(client_id) == []  # it waits for the export, not failed
    await _ended(h, export, ONNX)
    assert len(h.workers("emb")) == 4


async def test_a_worker_that_finds_no_export_after_the_daemons_failed_fails_its_load(
        make_harness: MakeHarness) -> None:
    h, export = _forced_onnx(make_harness)
    await h.settle()
    export.end("the ONNX export exited with -9: ")  # died, wrote nothing
    await h.settle()
    sink = h.sink()
    client_id = h.embed(sink, ["a"])
    await h.settle()
    worker = h.workers("emb")[0]
    h.pool.handle(worker, ExportFirst(entry="/cache/onnx/abc", model_dir="/models/emb"))
    h.die(worker, 0)
    model = h.pool.models["emb"]
    assert model.failures.count == 1 and "exited with -9" in (model.failures.last_error or "")
    assert len(export.calls) == 1  # not tried again: the model backs off instead
    h.die(h.workers("emb")[1], 0)
    assert sink.only_error(client_id).code is ErrorCode.MODEL_LOAD_FAILED
