"""Scale-down ticks and the load/unload commands, on fake workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from modelpool.protocol.errors import ErrorCode
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor import control
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
    h.pool.tick()
    assert h.launcher.stopped == []

    h.clock.advance(0.1)
    h.pool.tick()
    h.pool.tick()  # same instant: still one per cooldown
    assert h.launcher.stopped == [b]
    await h.settle()
    assert list(h.pool.models["emb"].workers.values()) == [a]

    h.clock.advance(59.9)
    h.pool.tick()
    assert h.launcher.stopped == [b]
    h.clock.advance(0.1)
    h.pool.tick()
    assert h.launcher.stopped == [b, a]
    await h.settle()
    assert h.pool.models["emb"].state_name() == "cold"

    h.clock.advance(600)
    h.pool.tick()
    assert len(h.launcher.stopped) == 2


async def test_no_scale_down_while_work_waits_or_runs(make_harness: MakeHarness) -> None:
    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     max_workers=1)
    h = make_harness(models=[spec], cooldown_idle_s=60)
    sink = h.sink()
    h.embed(sink, ["a"], timeout_s=1000)
    await h.settle()
    (worker,) = h.workers("emb")
    h.ready(worker)
    h.embed(sink, ["c"], timeout_s=1000)  # waits: the one worker is busy and at its cap
    model = h.pool.models["emb"]
    assert len(model.queue) == 1

    h.clock.advance(600)
    h.pool.tick()
    assert h.launcher.stopped == []

    for job_id in list(worker.jobs):
        h.reply_embeddings(worker, job_id, 1.0)
    h.want_work(worker)  # takes "c"
    assert len(model.queue) == 0 and worker.jobs
    h.pool.tick()
    assert h.launcher.stopped == []

    h.reply_embeddings(worker, next(iter(worker.jobs)), 1.0)
    h.want_work(worker)
    h.clock.advance(59)  # the cooldown counts from the last completion
    h.pool.tick()
    assert h.launcher.stopped == []
    h.clock.advance(1)
    h.pool.tick()
    assert h.launcher.stopped == [worker]


async def test_load_model_warms_workers_up_to_the_cap_by_alias(
        make_harness: MakeHarness) -> None:
    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     aliases=["e"])
    h = make_harness(models=[spec], max_workers_per_model=3, max_concurrent_loads=2)
    message = control.load_model(h.pool, "E", 10)
    await h.settle()
    assert len(h.workers("emb")) == 2  # two load slots
    assert "keeping 3 worker" in message
    assert "asked for 10, capped at 3: [pool] max_workers_per_model = 3" in message
    h.ready(h.workers("emb")[0])  # a slot frees: the third starts without any request
    await h.settle()
    assert len(h.workers("emb")) == 3
    control.load_model(h.pool, "emb", 2)
    await h.settle()
    assert len(h.workers("emb")) == 3  # already enough live or starting


async def test_unload_model_stops_every_worker(make_harness: MakeHarness) -> None:
    h = make_harness()
    control.load_model(h.pool, "emb", 2)
    await h.settle()
    control.unload_model(h.pool, "emb")
    assert h.launcher.stopped == h.workers("emb")
    await h.settle()
    assert h.pool.models["emb"].workers == {}


def test_management_on_an_unknown_model_is_unknown_model(make_harness: MakeHarness) -> None:
    h = make_harness()
    for command in (lambda: control.load_model(h.pool, "nope", 1),
                    lambda: control.unload_model(h.pool, "nope")):
        with pytest.raises(control.ControlError) as raised:
            command()
        assert raised.value.code is ErrorCode.UNKNOWN_MODEL


async def test_unload_while_loading_is_not_a_load_failure(make_harness: MakeHarness) -> None:
    """Workers stopped before Ready are killed (they read no Shutdown while loading);
    the next request must load at once, not wait out a load-failure back-off."""
    h = make_harness()
    h.launcher.exit_on_stop = False
    control.load_model(h.pool, "emb", 2)
    await h.settle()
    loading = h.workers("emb")
    control.unload_model(h.pool, "emb")
    for worker in loading:
        h.launcher.exit(worker, -9)
    await h.settle()
    model = h.pool.models["emb"]
    failures = model.failures
    assert (failures.count, failures.blocked_until, failures.last_error) == (0, 0.0, None)
    sink = h.sink()
    h.embed(sink, ["again"])
    await h.settle()
    assert [w.state for w in model.workers.values()] == [WorkerState.LOADING] * 2


async def test_load_of_a_model_whose_files_are_missing_fails_at_once(
        make_harness: MakeHarness) -> None:
    from modelpool.registry.sources import Missing

    h = make_harness()
    h.pool.intake.missing_files = lambda spec: Missing(f"path of {spec.key} does not exist")
    with pytest.raises(control.ControlError) as err:
        control.load_model(h.pool, "emb", 1)
    assert err.value.code is ErrorCode.MODEL_LOAD_FAILED
    assert "path of emb does not exist" in err.value.message
    await h.settle()
    assert h.workers("emb") == []
    sink = h.sink()
    h.embed(sink, ["a"])  # a request is refused at once, the same way
    assert sink.errors()[-1].code is ErrorCode.MODEL_LOAD_FAILED
