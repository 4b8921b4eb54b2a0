"""The weights holder with fake processes: it starts before the workers, they map what it
shares, it outlives them, and its death or failure is handled without reading freed
memory: GPU workers are killed and their work re-queued, CPU ones drained."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import pytest

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.pipes import CpuStorage, SharedTensor, SharedWeights, Work
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import control, gpus, shutdown
from modelpool.supervisor.gpus import Gpu
from modelpool.supervisor.shm import SHM_DIR, weights_segment
from modelpool.supervisor.status import build_status, refresh_memory
from modelpool.supervisor.workers import WorkerState

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Harness

    MakeHarness = Callable[..., Harness]

GPUS = [Gpu(0, 4000.0, "Fake")]
WEIGHTS = SharedWeights(storages=[CpuStorage(0, 64)],
                        tensors=[SharedTensor("/w", False, 0, 0, [16], [1], "float32")])


def gpu_model(**fields: object) -> ModelSpec:
    return ModelSpec(key="emb", capability="text_embedding", path="/x", device="cuda:0",
                     weights_mb=1000, per_worker_mb=100, **fields)  # type: ignore[arg-type]


def cpu_model() -> ModelSpec:
    return ModelSpec(key="emb", capability="text_embedding", path="/x", device="cpu",
                     weights_holder="on", weights_mb=100, per_worker_mb=10)


async def held_and_serving(h: Harness) -> list[int]:
    """A request, the holder's Ready, the cold start; returns the request's job ids."""
    sink = h.sink()
    h.embed(sink, ["x"])
    await h.settle()
    (holder,) = h.holders("emb")
    assert h.workers("emb") == []  # nothing to map yet
    h.hold(holder, WEIGHTS, vram_mb=900)
    await h.settle()
    for worker in h.workers("emb"):
        h.ready(worker)
    return h.job_ids(h.workers("emb")[0])


async def test_gpu_workers_map_the_holders_weights_charged_once(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[gpu_model()], gpus=GPUS, memory_fraction=1.0)
    await held_and_serving(h)
    holder_settings, *worker_settings = h.launcher.settings
    assert holder_settings.hold_segment and holder_settings.weights is None
    assert len(worker_settings) == 2 and all(s.weights == WEIGHTS for s in worker_settings)
    assert h.used_mb("cuda:0") == 900 + 2 * 100  # weights once, as measured
    status = build_status(h.pool, "/s", 0.0)
    (model,) = [m for m in status.models if m.key == "emb"]
    assert [(w.state, w.holds_weights) for w in model.workers][-1] == ("holding", True)


async def test_gpu_processes_are_charged_their_whole_vram_as_nvidia_smi_sees_it(
        make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's reserved memory leaves out the CUDA context; nvidia-smi's per-process
    figure does not, and replaces it once measured."""
    h = make_harness(models=[gpu_model()], gpus=GPUS, memory_fraction=1.0)
    await held_and_serving(h)
    (holder,), (first, second) = h.holders("emb"), h.workers("emb")
    assert h.used_mb("cuda:0") == 900 + 2 * 100
    used = {holder.pid: 1250.0, first.pid: 420.0, second.pid: 380.0, 99999: 5.0}
    monkeypatch.setattr(gpus, "process_vram_mb", lambda: used)
    await refresh_memory(h.pool)
    assert h.used_mb("cuda:0") == 1250 + 2 * 420  # the larger worker, each


async def test_weights_holder_off_loads_a_copy_per_gpu_worker(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[gpu_model(weights_holder="off")], gpus=GPUS)
    h.embed(h.sink(), ["x"])
    await h.settle()
    assert h.holders("emb") == [] and len(h.workers("emb")) == 2


async def test_the_holder_stops_only_after_its_last_worker(make_harness: MakeHarness) -> None:
    h = make_harness(models=[cpu_model()])
    (job_id,) = await held_and_serving(h)
    (holder,) = h.holders("emb")
    worker = h.workers("emb")[0]
    h.reply_embeddings(worker, job_id, 1.0)
    control.unload_model(h.pool, "emb")
    assert holder not in h.launcher.stopped  # workers may still be mapping its weights
    await h.settle()
    assert h.pool.models["emb"].workers == {}
    assert holder in h.launcher.stopped
    await h.settle()
    assert h.pool.models["emb"].holder is None
    assert h.used_mb("cpu") == 0


async def test_no_worker_maps_a_holder_that_is_stopping(make_harness: MakeHarness) -> None:
    h = make_harness(models=[cpu_model()])
    h.launcher.exit_on_stop = False
    (job_id,) = await held_and_serving(h)
    (holder,) = h.holders("emb")
    h.reply_embeddings(h.workers("emb")[0], job_id, 1.0)
    control.unload_model(h.pool, "emb")
    for worker in h.workers("emb"):
        h.die(worker, 0)
    assert holder.state is WorkerState.STOPPING
    h.embed(h.sink(), ["again"])
    await h.settle()
    assert h.pool.models["emb"].workers == {}  # its weights are about to go
    h.die(holder, 0)
    await h.settle()
    assert len(h.holders("emb")) == 2 and h.pool.models["emb"].workers == {}


async def test_a_dead_gpu_holder_kills_its_workers_and_their_work_runs_again(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[gpu_model()], gpus=GPUS, memory_fraction=1.0)
    (job_id,) = await held_and_serving(h)
    (holder,) = h.holders("emb")
    h.die(holder, -9)
    await h.settle()
    assert set(h.launcher.killed) == set(h.workers("emb"))  # no kernel on freed memory
    await h.settle()
    (new_holder,) = [w for w in h.holders("emb") if w is not holder]
    h.hold(new_holder, WEIGHTS, vram_mb=900)
    await h.settle()
    fresh = [w for w in h.workers("emb") if w.state is WorkerState.LOADING]
    assert fresh
    h.ready(fresh[0])
    (work,) = [m for m in h.sent(fresh[0]) if isinstance(m, Work)]
    assert [item.job_id for item in work.items] == [job_id]  # re-queued, not lost


async def test_a_dead_cpu_holder_lets_its_workers_finish(make_harness: MakeHarness) -> None:
    h = make_harness(models=[cpu_model()])
    await held_and_serving(h)
    (holder,) = h.holders("emb")
    h.die(holder, -9)
    await h.settle()
    assert h.launcher.killed == []  # their private mappings outlive the holder
    assert set(h.launcher.stopped) == set(h.workers("emb"))


async def test_a_holder_that_fails_to_load_fails_the_waiting_requests(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[cpu_model()])
    sink = h.sink()
    client_id = h.embed(sink, ["x"])
    await h.settle()
    (holder,) = h.holders("emb")
    holder.load_error = "OSError: no such file"
    h.die(holder, 3)
    await h.settle()
    error = sink.only_error(client_id)
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "no such file" in error.message
    assert h.pool.models["emb"].failures.count == 1


@pytest.mark.parametrize("loaded", [True, False])
async def test_the_holders_segment_is_removed_when_it_dies(make_harness: MakeHarness,
                                                            loaded: bool) -> None:
    h = make_harness(models=[cpu_model()])
    h.embed(h.sink(), ["x"])
    await h.settle()
    (holder,) = h.holders("emb")
    name = weights_segment(holder.worker_id)
    assert name == h.launcher.settings[0].hold_segment and str(os.getpid()) in name
    (SHM_DIR / name).write_bytes(b"\0" * 64)  # what the holder process would write
    if loaded:
        h.hold(holder, SharedWeights(segment=name, segment_bytes=64), weights_mb=0.1)
    h.die(holder, -9)  # also half-way through writing it
    assert not (SHM_DIR / name).exists()


@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cuda:0", True), ("auto", "cpu", False), ("on", "cpu", True),
    ("off", "cuda:0", False)])
def test_who_uses_a_holder(make_harness: MakeHarness, setting: str, device: str,
                           expected: bool) -> None:
    spec = ModelSpec(key="emb", capability="text_embedding", path="/x", device=device,
                     weights_holder=setting)  # type: ignore[arg-type]
    h = make_harness(models=[spec], gpus=GPUS)
    assert h.pool.models["emb"].uses_holder is expected


async def test_shutdown_stops_the_holder_after_its_workers(make_harness: MakeHarness) -> None:
    h = make_harness(models=[gpu_model()], gpus=GPUS, memory_fraction=1.0)
    (job_id,) = await held_and_serving(h)
    h.reply_embeddings(h.workers("emb")[0], job_id, 1.0)
    h.pool.models["emb"].warm_target = 2  # `modelpool load`: only the shutdown stops it
    h.pool.shutting_down = True  # as drain_and_stop sets it
    h.launcher.exit_on_stop = False
    stopping = asyncio.create_task(shutdown.stop_all_workers(h.pool, h.clock.now() + 1.0))
    await h.settle()
    (holder,) = h.holders("emb")
    assert set(h.launcher.stopped) == set(h.workers("emb"))  # not the holder yet
    for worker in h.workers("emb"):
        h.die(worker, 0)
    await h.settle()
    assert h.launcher.stopped[-1] is holder
    h.die(holder, 0)
    await stopping
    assert h.pool.models["emb"].processes() == [] and h.launcher.killed == []


async def test_a_worker_loading_when_its_holder_dies_is_no_load_failure(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[cpu_model()])
    h.launcher.exit_on_stop = False
    sink = h.sink()
    client_id = h.embed(sink, ["x"])
    await h.settle()
    (holder,) = h.holders("emb")
    h.hold(holder, WEIGHTS, weights_mb=0.1)
    await h.settle()
    loading = h.workers("emb")
    h.die(holder, -9)
    for worker in loading:  # they find the segment gone
        worker.load_error = "RuntimeError: unable to open file"
        h.die(worker, 3)
    await h.settle()
    assert sink.finals(client_id) == [] and h.pool.models["emb"].failures.count == 0
    assert len(h.holders("emb")) == 2  # the request waits for the next holder
