"""Adaptive intra-op threads: a batch may use the cores its idle siblings leave."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conftest import rows

from modelpool.protocol.messages import Embeddings
from modelpool.protocol.pipes import Threads
from modelpool.supervisor.workers import WorkerHandle

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


def _two_cores(h: Harness, model: str = "emb") -> None:
    """The same figures on any machine: 2 cores, a share of 1 thread per worker."""
    h.pool.dispatcher.threads.cpus = 2  # type: ignore[union-attr]
    state = h.pool.models[model]
    state.settings = dataclasses.replace(state.settings, threads=1)


async def _first_of_two_ready(h: Harness) -> tuple[Any, WorkerHandle, WorkerHandle]:
    """Two cores; a text to embed started the model's two workers and the first is ready
    (and was sent it): the client's sink and the two workers."""
    _two_cores(h)
    sink = h.sink()
    h.embed(sink, ["a"])
    await h.settle()
    first, second = h.workers("emb")
    h.ready(first)
    return sink, first, second


async def test_lone_batch_gets_every_core_and_busy_siblings_keep_their_share(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink, first, second = await _first_of_two_ready(h)
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


async def test_the_parts_of_a_split_request_keep_their_share_and_a_lone_part_gets_all(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=2, max_batch=2)
    sink, first, second = await _first_of_two_ready(h)
    h.ready(second)
    (work,) = h.works(first)
    h.reply_embeddings(first, work.items[0].job_id, 0.5)
    h.want_work(first)
    h.embed(sink, ["b", "c", "d", "e"])  # two parts of two, one for each worker
    parts = [h.works(first)[-1], *h.works(second)]
    assert [len(w.items) for w in parts] == [1, 1] and [w.threads for w in parts] == [1, 1]
    for worker, part in zip((first, second), parts, strict=True):
        h.pool.handle(worker, Embeddings(id=part.items[0].job_id, data=rows(0.5, 0.5),
                                         shape=[2, 1]))
        h.want_work(worker)
    h.embed(sink, ["f", "g"])  # one part: nothing else to run, every core
    assert max(len(h.works(first)), len(h.works(second))) == 3
    latest = max((h.works(first)[-1], h.works(second)[-1]), key=lambda w: w.items[0].job_id)
    assert latest.threads == 2


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
    h.die(h.workers("emb")[0], -9)
    assert _threads_told(h, h.workers("gen")[0]) == []


def _threads_told(h: Harness, worker: WorkerHandle) -> list[int]:
    return [m.count for m in h.sent(worker) if isinstance(m, Threads)]


async def test_a_lone_stream_gets_every_core_and_shares_them_while_others_run(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    _two_cores(h, "gen")
    _two_cores(h, "emb")
    sink = h.sink()
    h.generate(sink)
    await h.settle()
    gen = h.workers("gen")[0]
    h.ready(gen)
    assert [w.threads for w in h.works(gen)] == [2]  # nothing else runs: both cores

    h.embed(sink, ["a"])
    await h.settle()
    emb = h.workers("emb")[0]
    h.ready(emb)
    assert [w.threads for w in h.works(emb)] == [1]  # the stream holds both
    assert _threads_told(h, gen) == [1]  # ... and gives one back while the batch runs

    h.reply_embeddings(emb, h.job_ids(emb)[0], 0.5)
    assert _threads_told(h, gen) == [1, 2]  # the batch is done: both cores again

    h.end(gen, h.job_ids(gen)[0])
    h.want_work(emb)
    h.embed(sink, ["b"])
    assert h.works(emb)[-1].threads == 2  # the stream ended: the batch gets both
    assert _threads_told(h, gen) == [1, 2]  # a worker running nothing is not told


async def test_streams_of_two_workers_share_the_cores_and_a_death_frees_them(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=2)
    _two_cores(h, "gen")
    sink = h.sink()
    h.generate(sink, prompt="one")
    await h.settle()
    first, second = h.workers("gen")
    h.ready(first)
    h.generate(sink, prompt="two")
    h.ready(second)
    assert [w.threads for w in h.works(first) + h.works(second)] == [2, 1]
    assert _threads_told(h, first) == [1]

    h.die(second, -9)
    assert _threads_told(h, first) == [1, 2]
