"""Adaptive intra-op threads: a batch may use the cores its idle siblings leave."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from modelpool.registry.spec import ModelSpec

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


def _two_cores(h: Harness, model: str = "emb") -> None:
    """The same figures on any machine: 2 cores, a share of 1 thread per worker."""
    h.pool.dispatcher.threads.cpus = 2  # type: ignore[union-attr]
    state = h.pool.models[model]
    state.settings = dataclasses.replace(state.settings, threads=1)


async def test_lone_batch_gets_every_core_and_busy_siblings_keep_their_share(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    _two_cores(h)
    sink = h.sink()
    h.embed(sink, ["a"])
    await h.settle()
    first, second = h.workers("emb")
    h.ready(first)
    ((work,),) = [h.works(first)]
    assert work.threads == 2  # nothing else runs: both cores

    h.ready(second)
    h.embed(sink, ["b"])
    (work2,) = h.works(second)
    assert work2.threads == 1  # the first holds both cores: its own share only

    (job_id,) = [item.job_id for item in work.items]
    h.reply_embeddings(first, job_id, 0.5)
    h.want_work(first)
    h.embed(sink, ["c"])
    assert h.works(first)[-1].threads == 1  # the second is busy on its one core

    (job2,) = [item.job_id for item in work2.items]
    h.reply_embeddings(second, job2, 0.5)
    h.want_work(second)
    h.embed(sink, ["d"])
    assert h.works(second)[-1].threads == 1  # the first still holds one


async def test_generation_and_hand_set_threads_are_left_alone(
        make_harness: MakeHarness) -> None:
    h = make_harness(threads_per_worker=1)
    _two_cores(h)
    sink = h.sink()
    h.embed(sink, ["a"])
    h.generate(sink)
    await h.settle()
    for model in ("emb", "gen"):
        worker = h.workers(model)[0]
        h.ready(worker)
        assert [w.threads for w in h.works(worker)] == [0]  # 0: keep what it was told


async def test_generation_keeps_its_share_with_automatic_threads(
        make_harness: MakeHarness) -> None:
    models = [ModelSpec(key="gen", capability="text_to_text", path="/nonexistent",
                        weights_mb=10, per_worker_mb=10)]
    h = make_harness(models=models)
    _two_cores(h, "gen")
    sink = h.sink()
    h.generate(sink)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    assert [w.threads for w in h.works(worker)] == [0]
