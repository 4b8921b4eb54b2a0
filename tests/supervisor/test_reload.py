"""What applying a reload's plan does to a pool of fake workers (the plan itself:
test_reload_plan.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from test_reload_plan import spec

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.fields import RequestDefaults
from modelpool.protocol.messages import Embeddings, EmbedImage, ImageInput
from modelpool.protocol.pipes import ImagePolicy, Threads
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import control
from modelpool.supervisor.cli import _model_text
from modelpool.supervisor.reload import (
    IMAGES_CHANGED,
    REPLACED_BECAUSE,
    STARTED_WITH_CHANGED,
    apply_reload,
    plan_reload,
)
from modelpool.supervisor.status import build_status
from modelpool.supervisor.workers import WorkerHandle, WorkerState

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


# ---- applied to a pool ------------------------------------------------------------------


def reload(h: Harness, *models: ModelSpec, **sections: Any) -> str:
    """The harness's config with these models (the catalogue's stay) and sections."""
    new = msgspec.structs.replace(h.pool.config, models=list(models), **sections)
    plan = plan_reload(h.pool.registry.specs, new.registry().specs, h.pool.config, new)
    apply_reload(h.pool, plan, new)
    return plan.summary()


async def test_a_removed_model_serves_what_it_has_then_goes(make_harness: MakeHarness) -> None:
    h = make_harness(models=[spec("a", max_workers=1), spec("b")])
    sink = h.sink()
    running, queued = h.embed(sink, ["x"], model="a"), h.embed(sink, ["y"], model="a")
    await h.settle()
    (worker,) = h.workers("a")
    h.ready(worker)
    reload(h, spec("b"))

    late = h.embed(sink, ["z"], model="a")
    assert sink.only_error(late).code is ErrorCode.UNKNOWN_MODEL
    assert h.pool.models["a"].state_name() == "removing"
    h.pool.tick()
    assert h.launcher.stopped == []  # work is still there
    h.reply_embeddings(worker, next(iter(worker.jobs)), 1.0)
    h.want_work(worker)
    h.reply_embeddings(worker, next(iter(worker.jobs)), 2.0)
    assert all(isinstance(m, Embeddings) for m in sink.finals(running) + sink.finals(queued))
    h.want_work(worker)
    h.pool.tick()
    assert h.launcher.stopped == [worker]
    await h.settle()
    assert "a" not in h.pool.models
    assert "b" in h.pool.models


async def test_a_removed_idle_model_stops_at_once_and_can_come_back(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[spec("a"), spec("b")])
    control.load_model(h.pool, "a", 1)
    await h.settle()
    (worker,) = h.workers("a")
    h.ready(worker)
    reload(h, spec("b"))
    assert h.launcher.stopped == [worker]  # not kept up by `load` any more
    assert h.pool.models["a"].warm_target == 0
    reload(h, spec("a"), spec("b"))  # back before its worker has gone: it stays
    await h.settle()
    assert not h.pool.models["a"].retiring
    sink = h.sink()
    ok = h.embed(sink, ["x"], model="a")
    await h.settle()
    new = h.workers("a")[1]  # (the model is cold again: it starts its cold-start workers)
    h.ready(new)
    h.reply_embeddings(new, next(iter(new.jobs)), 1.0)
    assert isinstance(sink.finals(ok)[0], Embeddings)


async def _served_once(h: Harness, key: str) -> WorkerHandle:
    """The model's one worker, loaded, having served a request, idle."""
    h.embed(h.sink(), ["x"], model=key)
    await h.settle()
    (worker,) = h.workers(key)
    h.ready(worker)
    h.reply_embeddings(worker, next(iter(worker.jobs)), 1.0)
    h.want_work(worker)
    return worker


async def test_a_model_loading_something_else_has_its_workers_replaced(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[spec("a", max_workers=1)])
    old = await _served_once(h, "a")

    summary = reload(h, spec("a", max_workers=1, options={"mark": 2}))
    assert summary == "replaced (its workers, one at a time): a"
    assert old.outdated == REPLACED_BECAUSE
    shown = msgspec.to_builtins(build_status(h.pool, "/s", 0.0))
    assert ("replacing 1 worker(s), one at a time as memory allows: its model's config "
            "changed (reload)") in "\n".join(_model_text(next(
                m for m in shown["models"] if m["key"] == "a")))
    h.pool.tick()
    await h.settle()
    assert h.launcher.stopped == [old]
    (new,) = h.workers("a")[1:]
    assert h.launcher.settings[-1].spec.options == {"mark": 2}
    assert new.outdated is None


async def test_new_limits_apply_at_once(make_harness: MakeHarness) -> None:
    h = make_harness(models=[spec("a")])
    assert reload(h, spec("a", max_queue=1, aliases=["alpha"])) == "updated: a"
    model = h.pool.models["a"]
    assert model.settings.max_queue == 1
    sink = h.sink()
    h.embed(sink, ["x"], model="ALPHA", timeout_s=100)
    refused = h.embed(sink, ["y"], model="alpha", timeout_s=100)
    assert sink.only_error(refused).code is ErrorCode.QUEUE_FULL


async def test_an_added_model_is_served(make_harness: MakeHarness) -> None:
    h = make_harness(models=[spec("a")])
    reload(h, spec("a"), msgspec.structs.replace(spec("b"), default=True))
    assert h.pool.registry.defaults["text_embedding"] == "b"
    sink = h.sink()
    ok = h.embed(sink, ["x"], model="b")
    await h.settle()
    (worker,) = h.workers("b")[:1]
    assert worker.state is WorkerState.LOADING
    h.ready(worker)
    h.reply_embeddings(worker, next(iter(worker.jobs)), 1.0)
    assert isinstance(sink.finals(ok)[0], Embeddings)


async def test_defaults_and_images_apply_at_once(make_harness: MakeHarness) -> None:
    """[defaults] to the next request; [images] at admission at once, and in the workers
    of models taking images, which enforce its pixel limits, once they are replaced."""
    image = spec("img", capability="image_embedding")
    h = make_harness(models=[spec("gen", capability="text_to_text"), image],
                     cold_start_workers=1)
    sink = h.sink()
    h.generate(sink, model="gen")
    await h.settle()
    (gen,) = h.workers("gen")
    h.ready(gen)
    (before,) = [request for _, request in h.items(h.works(gen)[-1])]
    assert before.sampling.max_tokens == 256
    h.end(gen, h.job_ids(gen)[-1])
    h.want_work(gen)
    h.pool.submit(sink, EmbedImage(id=99, model="img", images=[ImageInput(data=b"x")]))
    await h.settle()
    (img,) = h.workers("img")

    summary = reload(h, spec("gen", capability="text_to_text"), image,
                     defaults=RequestDefaults(max_tokens=7),
                     images=ImagePolicy(max_bytes=1))
    assert summary == "[defaults], [images] applied"
    h.generate(sink, model="gen")
    (after,) = [request for _, request in h.items(h.works(gen)[-1])]
    assert after.sampling.max_tokens == 7
    assert gen.outdated is None and img.outdated == IMAGES_CHANGED
    refused = h.pool.submit(sink, EmbedImage(id=100, model="img",
                                             images=[ImageInput(data=b"xy")]))
    assert not refused and sink.only_error(100).code is ErrorCode.IMAGE_TOO_LARGE
    new_worker = h.pool.model_state(image).worker_settings(0, False, h.pool.pool_config,
                                                           h.pool.config.images)
    assert new_worker.images.max_bytes == 1


async def test_a_models_generation_config_switched_off_applies_at_once(
        make_harness: MakeHarness, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20}')
    gen = spec("gen", capability="text_to_text", path=str(tmp_path))
    h = make_harness(models=[gen], cold_start_workers=1)
    sink = h.sink()
    h.generate(sink, model="gen")
    await h.settle()
    (worker,) = h.workers("gen")
    h.ready(worker)
    (before,) = [request for _, request in h.items(h.works(worker)[-1])]
    assert (before.sampling.temperature, before.sampling.top_k) == (0.6, 20)
    h.end(worker, h.job_ids(worker)[-1])
    h.want_work(worker)

    summary = reload(h, msgspec.structs.replace(gen, generation_config=False))
    assert summary == "updated: gen" and worker.outdated is None  # nothing to reload
    h.generate(sink, model="gen")
    (after,) = [request for _, request in h.items(h.works(worker)[-1])]
    assert (after.sampling.temperature, after.sampling.top_k) == (1.0, 0)


async def test_pool_settings_apply_at_once_and_workers_started_otherwise_are_replaced(
        make_harness: MakeHarness) -> None:
    """[pool]: queue bounds, timeouts, batching, scaling and the memory budget from the
    next request on; a worker keeps the threads and forward-pass batch it started with,
    so a change of those replaces the workers, one at a time."""
    h = make_harness(models=[spec("a", max_workers=1)], cold_start_workers=1)
    worker = await _served_once(h, "a")
    sink = h.sink()
    pool = msgspec.structs.replace(h.pool.pool_config, max_queue=1, timeout_s=7.0,
                                   max_batch_wait_ms=5.0, cooldown_idle_s=9.0,
                                   memory_budget_mb=4321.0, max_queued_total=3)

    assert reload(h, spec("a", max_workers=1), pool=pool) == "[pool] applied"
    model = h.pool.models["a"]
    assert (model.settings.max_queue, model.settings.timeout_s) == (1, 7.0)
    assert h.pool.dispatcher.batch_wait_s == 0.005 and h.pool.policy.cooldown_idle_s == 9.0
    assert h.pool.capacity.budget_for("cpu") == 4321.0
    assert worker.outdated is None  # limits only: it serves on as it is
    held = h.embed(sink, ["y"], model="a", timeout_s=100)  # runs on the idle worker
    waits = h.embed(sink, ["z"], model="a", timeout_s=100)
    refused = h.embed(sink, ["w"], model="a", timeout_s=100)
    assert sink.only_error(refused).code is ErrorCode.QUEUE_FULL
    assert not sink.finals(held) and not sink.finals(waits)

    fewer = msgspec.structs.replace(pool, threads_per_worker=model.settings.threads + 1)
    assert reload(h, spec("a", max_workers=1), pool=fewer) == "[pool] applied"
    assert worker.outdated == STARTED_WITH_CHANGED
    assert model.worker_settings(0, False, h.pool.pool_config,
                                 h.pool.config.images).threads == model.settings.threads


async def test_a_models_new_threads_or_batch_replace_its_workers(
        make_harness: MakeHarness) -> None:
    h = make_harness(models=[spec("a"), spec("b")], cold_start_workers=1)
    sink = h.sink()
    for key in ("a", "b"):
        h.embed(sink, ["x"], model=key)
    await h.settle()
    (a,), (b,) = h.workers("a"), h.workers("b")
    assert reload(h, spec("a", max_batch=4), spec("b", max_queue=5)) == "updated: a, b"
    assert a.outdated == STARTED_WITH_CHANGED and b.outdated is None


async def test_a_stream_of_a_model_added_by_a_reload_shares_the_cores(
        make_harness: MakeHarness) -> None:
    """The streams granted threads again as others start and stop include those of
    models added since the start."""
    h = make_harness(models=[spec("emb")], cold_start_workers=1)
    reload(h, spec("emb"), spec("gen", capability="text_to_text"))
    h.pool.dispatcher.threads.cpus = 2  # type: ignore[union-attr]
    for key in ("emb", "gen"):  # a share of one thread each, on any machine
        state = h.pool.models[key]
        state.settings = dataclasses.replace(state.settings, threads=1)
    sink = h.sink()
    h.generate(sink, model="gen")
    await h.settle()
    (gen,) = h.workers("gen")
    h.ready(gen)
    h.embed(sink, ["a"], model="emb")
    await h.settle()
    (emb,) = h.workers("emb")
    h.ready(emb)
    assert [m.count for m in h.sent(gen) if isinstance(m, Threads)] == [1]
