"""GPU discovery, device resolution and per-GPU memory accounting, with fake GPUs (the
real ones are exercised by tests marked `gpu`, skipped on machines without CUDA)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.pipes import SharedWeights
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.gpus import Gpu, parse_compute_apps, parse_nvidia_smi, resolve_device
from modelpool.supervisor.memory import ModelCharge
from modelpool.supervisor.status import build_status

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Harness

    MakeHarness = Callable[..., Harness]

GPUS = [Gpu(0, 1000.0, "Fake A"), Gpu(1, 2000.0, "Fake B")]


def test_parse_nvidia_smi() -> None:
    text = "0, 24576, NVIDIA L4\n1, 81920, NVIDIA A100-SXM4-80GB\nbogus line\n"
    assert parse_nvidia_smi(text) == [Gpu(0, 24576.0, "NVIDIA L4"),
                                     Gpu(1, 81920.0, "NVIDIA A100-SXM4-80GB")]
    assert parse_nvidia_smi("") == []


def test_parse_compute_apps_sums_each_process_over_gpus() -> None:
    text = "4242, 1200\n4243, 300\n4242, 800\n4244, [N/A]\nNo running processes found\n"
    assert parse_compute_apps(text) == {4242: 2000.0, 4243: 300.0}
    assert parse_compute_apps("") == {}


def test_resolve_device() -> None:
    assert resolve_device("auto", []) == "cpu"
    assert resolve_device("auto", GPUS) == "cuda:0"
    assert resolve_device("cuda", GPUS) == "cuda:0"
    assert resolve_device("cuda:1", GPUS) == "cuda:1"
    assert resolve_device("cpu", GPUS) == "cpu"
    assert resolve_device("cuda", []) is None
    assert resolve_device("cuda:2", GPUS) is None
    assert resolve_device("tpu", GPUS) is None


def test_gpu_workers_each_pay_for_their_weights() -> None:
    gpu = ModelCharge(weights_mb=300, per_worker_mb=50, workers=2, shared_weights=False)
    assert gpu.charged_mb == 700 and gpu.next_worker_mb == 350
    cpu = ModelCharge(weights_mb=300, per_worker_mb=50, workers=2)
    assert cpu.charged_mb == 400 and cpu.next_worker_mb == 50


def gpu_harness(make_harness: MakeHarness, *specs: ModelSpec) -> Harness:
    return make_harness(models=list(specs), gpus=GPUS, cold_start_workers=1,
                        memory_fraction=0.5)


async def test_models_are_placed_and_budgeted_per_gpu(make_harness: MakeHarness) -> None:
    a = ModelSpec(key="a", capability="text_embedding", path="/x", device="cuda:0",
                  weights_mb=300, per_worker_mb=100)
    b = ModelSpec(key="b", capability="text_embedding", path="/x", device="cuda:1",
                  weights_mb=300, per_worker_mb=100)
    h = gpu_harness(make_harness, a, b)
    sink = h.sink()
    h.embed(sink, ["x"], model="a")
    h.embed(sink, ["y"], model="b")
    await h.settle()
    assert [s.spec.device for s in h.launcher.settings] == ["cuda:0", "cuda:1"]  # holders
    assert h.pool.capacity.budget_for("cuda:0") == 500  # memory_fraction x VRAM
    assert h.used_mb("cuda:0") == 300 and h.used_mb("cpu") == 0
    for key in "ab":
        h.hold(h.holders(key)[0], SharedWeights())
    await h.settle()
    assert [s.spec.device for s in h.launcher.settings[2:]] == ["cuda:0", "cuda:1"]
    assert h.used_mb("cuda:0") == 400
    status = build_status(h.pool, "/s", 0.0)
    assert {g.device: g.used_mb for g in status.memory.gpus} == {"cuda:0": 400, "cuda:1": 400}
    assert {m.key: m.device for m in status.models if m.key in "ab"} == {
        "a": "cuda:0", "b": "cuda:1"}


async def test_an_idle_model_on_another_device_is_not_evicted(
        make_harness: MakeHarness) -> None:
    on_cpu = ModelSpec(key="c", capability="text_embedding", path="/x", device="cpu",
                       weights_mb=10, per_worker_mb=10)
    big = ModelSpec(key="g", capability="text_embedding", path="/x", device="cuda:0",
                    weights_mb=450, per_worker_mb=100)
    h = gpu_harness(make_harness, on_cpu, big)
    sink = h.sink()
    h.embed(sink, ["x"], model="c")
    await h.settle()
    (worker,) = h.workers("c")
    h.ready(worker)
    h.reply_embeddings(worker, h.job_ids(worker)[0], 1.0)
    h.want_work(worker)
    h.embed(sink, ["y"], model="g")  # 550 > 500 on cuda:0: can never fit there
    (error,) = sink.errors()
    assert error.code is ErrorCode.INSUFFICIENT_MEMORY and "cuda:0" in error.message
    assert h.launcher.stopped == []  # evicting the CPU model would not have helped


async def test_a_model_asking_for_a_missing_gpu_fails_clearly(
        make_harness: MakeHarness) -> None:
    spec = ModelSpec(key="m", capability="text_embedding", path="/x", device="cuda:7")
    h = gpu_harness(make_harness, spec)
    sink = h.sink()
    h.embed(sink, ["x"], model="m")
    (error,) = sink.errors()
    assert error.code is ErrorCode.MODEL_LOAD_FAILED and "cuda:7" in error.message
    assert h.launcher.started == []
