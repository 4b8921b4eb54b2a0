"""The pool and a worker that batches streams: it grants slots with WantWork(slots=n),
gets one stream per slot (several in one Work) while it runs others, stays busy until
its last stream ends, and each stream keeps its one ending when the worker dies."""

from __future__ import annotations

from collections.abc import Callable

from conftest import FakeSink, Harness

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Chunk, End
from modelpool.protocol.pipes import Abort, Heartbeat, WantWork
from modelpool.supervisor.affinity import SLACK
from modelpool.supervisor.status import build_status
from modelpool.supervisor.throughput import TokenRate
from modelpool.supervisor.workers import WorkerHandle, WorkerState

MakeHarness = Callable[..., Harness]


async def _batching_worker(h: Harness, slots: int) -> WorkerHandle:
    sink = h.sink()
    h.generate(sink, "first")  # a cold start: one worker
    await h.settle()
    (worker,) = h.workers("gen")
    h.ready(worker, want_work=False, info={"context": 64, "max_active_sequences": slots})
    h.pool.handle(worker, WantWork(slots=slots))
    return worker


async def test_a_grant_of_slots_takes_one_stream_each_in_one_work(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_workers_per_model=1)
    sink = h.sink()
    worker = await _batching_worker(h, 4)
    for n in range(5):
        h.generate(sink, f"p{n}")
    # The queued first request went at the grant; four more came: three fit, one waits.
    assert [len(w.items) for w in h.works(worker)] == [1, 1, 1, 1]
    assert worker.slots == 0 and len(worker.jobs) == 4 and len(h.pool.models["gen"].queue) == 2
    assert worker.state is WorkerState.BUSY

    first, second = list(worker.jobs)[:2]
    h.end(worker, first)
    h.end(worker, second)
    h.pool.handle(worker, WantWork(slots=2))  # still running two: stays busy, takes two
    assert worker.state is WorkerState.BUSY
    assert len(h.works(worker)[-1].items) == 2 and len(h.pool.models["gen"].queue) == 0
    for job_id in list(worker.jobs):
        h.end(worker, job_id)
    h.pool.handle(worker, WantWork(slots=4))
    assert worker.state is WorkerState.IDLE and worker.slots == 4


async def _two_batching_workers(h: Harness, slots: int
                                ) -> tuple[FakeSink, WorkerHandle, WorkerHandle]:
    """Both ready, neither asked for work yet; a first request waits."""
    sink = h.sink()
    h.generate(sink, "first")
    await h.settle()
    a, b = h.workers("gen")
    for w in (a, b):
        h.ready(w, want_work=False, info={"max_active_sequences": slots})
    return sink, a, b


async def test_the_least_loaded_worker_gets_a_stream_first(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=2, max_workers_per_model=2)
    sink, a, b = await _two_batching_workers(h, 4)
    for w in (a, b):
        h.pool.handle(w, WantWork(slots=4))
    for n in range(5):
        h.generate(sink, f"p{n}")
    assert sorted([len(a.jobs), len(b.jobs)]) == [3, 3]  # spread, not stacked


async def test_a_dead_batching_worker_ends_each_stream_once(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_workers_per_model=1)
    sink = h.sink()
    worker = await _batching_worker(h, 4)
    ids = [h.generate(sink, f"p{n}") for n in range(3)]
    jobs = [j for j, job in worker.jobs.items() if job.request.prompt != "first"]
    h.chunk(worker, jobs[0], 0, "a")  # a stream that reached its client
    h.chunk(worker, jobs[1], 0, "b")
    h.die(worker, -9)
    await h.settle()
    assert [type(m).__name__ for m in sink.finals(ids[0])] == ["Error"]
    assert sink.only_error(ids[0]).code is ErrorCode.WORKER_DIED
    assert sink.only_error(ids[1]).code is ErrorCode.WORKER_DIED
    assert sink.finals(ids[2]) == []  # no chunk yet: queued again for a new worker
    assert len(h.pool.models["gen"].queue) >= 1


async def test_abort_reaches_the_worker_running_the_stream(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_workers_per_model=1)
    sink = h.sink()
    worker = await _batching_worker(h, 4)
    client_id = h.generate(sink, "cancel me")
    (job_id,) = [j for j, job in worker.jobs.items() if job.request.prompt == "cancel me"]
    h.pool.cancel(sink, client_id)
    assert Abort(job_id=job_id) in h.sent(worker)
    assert sink.only_error(client_id).code is ErrorCode.CANCELLED
    h.pool.handle(worker, End(id=job_id, finish_reason="cancelled"))  # crossed: dropped
    assert sink.finals(client_id)[1:] == []


async def test_status_shows_sequences_and_tokens_per_s(make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1, max_workers_per_model=1)
    worker = await _batching_worker(h, 8)
    sink = h.sink()
    h.generate(sink, "more")
    for n, tokens in enumerate((0, 100, 250, 400)):
        h.pool.handle_heartbeat(worker, Heartbeat(seq=n, progress=n, tokens=tokens))
        h.clock.advance(0.5)
    h.pool.handle(worker, Chunk(id=next(iter(worker.jobs)), seq=0, text="x"))
    model = next(m for m in build_status(h.pool, "/s", 0.0).models if m.key == "gen")
    (status,) = model.workers
    assert (status.sequences, status.max_sequences) == (2, 8)
    assert status.tokens_per_s == model.tokens_per_s == round(400 / 1.5, 1)
    assert model.tokens == 400


def test_token_rate_is_over_recent_beats_and_falls_to_zero() -> None:
    rate = TokenRate()
    assert rate.per_s(0.0) == 0.0
    for n in range(40):  # 20 tokens/s for 20 s, then nothing
        rate.note(n * 0.5, n * 10)
    assert rate.per_s(19.5) == 20.0
    assert len(rate.samples) <= 12  # only the last ~5 s are kept
    for n in range(40, 60):
        rate.note(n * 0.5, 390)
    assert rate.per_s(29.5) == 0.0
    assert rate.per_s(60.0) == 0.0 and rate.total == 390


async def test_a_request_starting_as_one_a_worker_ran_goes_to_it_unless_much_busier(
        make_harness: MakeHarness) -> None:
    """Where its prefix cache holds the start (affinity.py): within SLACK more streams
    than the least loaded worker runs, the like request goes there; beyond, it does not."""
    h = make_harness(cold_start_workers=2, max_workers_per_model=2)
    sink, a, b = await _two_batching_workers(h, 16)
    h.pool.handle(b, WantWork(slots=16))  # b alone asks: what comes goes to b
    h.generate(sink, "a shared start", seed=1)
    h.generate(sink, "something else")
    assert (len(a.jobs), len(b.jobs)) == (0, 3)
    h.pool.handle(a, WantWork(slots=16))
    for seed in (2, 3):  # b runs 3, then 4: within SLACK of a's none
        h.generate(sink, "a shared start", seed=seed)
    assert (len(a.jobs), len(b.jobs)) == (0, 5)
    h.generate(sink, "a shared start", seed=4)  # b runs 5, beyond 0 + SLACK
    h.generate(sink, "unlike any", seed=5)  # the least loaded
    assert (len(a.jobs), len(b.jobs)) == (2, 5)
    assert SLACK == 4
