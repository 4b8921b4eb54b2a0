"""A streamed job's kept replies on the pool with fakes: followed live and again once
ended, the same chunks each time; a job that fails ends its followers' stream with its
error; ended streams dropped past the results' retention and over their bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from test_jobservice import ME, OTHER, service

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.jobs import Follow, Submit
from modelpool.protocol.messages import Chunk, End, Error, Generate, Sampling
from modelpool.supervisor import jobstreams
from modelpool.supervisor.jobstreams import JobStreams

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


def streamed(prompt: str = "hi", stream: bool = True) -> Submit:
    return Submit(id=1, request=Generate(id=1, model="gen", prompt=prompt,
                                         sampling=Sampling(max_tokens=3)), stream=stream)


async def started(h: Harness, streams: JobStreams, msg: Submit) -> tuple[str, Any, int]:
    """The job submitted, and running on the model's one worker."""
    key = await streams.submit(ME, msg, 100)
    await h.settle()
    (worker,) = h.workers("gen")
    if h.job_ids(worker):
        h.want_work(worker)  # its last job ended
    else:
        h.ready(worker)
    await h.settle()
    return key, worker, h.job_ids(worker)[-1]


async def test_a_streamed_job_is_followed_live_then_again_alike(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    streams = JobStreams(service(h))
    key, worker, job_id = await started(h, streams, streamed())
    live: list[Any] = []
    following = asyncio.ensure_future(streams.follow(ME, Follow(id=9, key=key), live.append))
    for seq, text in enumerate(["Once", " upon"]):
        h.chunk(worker, job_id, seq, text)
        await h.settle()
        assert [c.text for c in live] == ["Once", " upon"][:seq + 1]  # as it comes
    h.chunk(worker, job_id, 2, " a")
    h.end(worker, job_id, reason="length")
    await h.settle()
    (end,) = await following
    assert isinstance(end, End) and (end.id, end.finish_reason) == (9, "length")
    assert all(isinstance(c, Chunk) and c.id == 9 for c in live)
    again: list[Any] = []
    assert (await streams.follow(ME, Follow(id=10, key=key), again.append))[0].id == 10
    assert [(c.seq, c.text) for c in again] == [(c.seq, c.text) for c in live]
    assert [c.seq for c in live] == [0, 1, 2]


async def test_without_stream_a_job_is_followed_whole_once_ended(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    streams = JobStreams(service(h))
    key, worker, job_id = await started(h, streams, streamed(stream=False))
    got: list[Any] = []
    following = asyncio.ensure_future(streams.follow(ME, Follow(id=9, key=key), got.append))
    h.chunk(worker, job_id, 0, "Once")
    await h.settle()
    assert got == []  # nothing kept as it ran: whole at the end
    h.chunk(worker, job_id, 1, " more")
    h.end(worker, job_id)
    await h.settle()
    chunk, end = await following
    assert (chunk.text, end.finish_reason) == ("Once more", "stop") and got == []


async def test_a_failed_jobs_followers_get_its_error_and_others_nothing(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs = service(h)
    streams = JobStreams(jobs)
    key, worker, job_id = await started(h, streams, streamed())
    seen: list[Any] = []  # another user's: as if the key did not exist
    (refused,) = await streams.follow(OTHER, Follow(id=9, key=key), seen.append)
    assert refused.code is ErrorCode.RESULT_NOT_FOUND and seen == []
    got: list[Any] = []
    following = asyncio.ensure_future(streams.follow(ME, Follow(id=9, key=key), got.append))
    h.chunk(worker, job_id, 0, "Once")
    await h.settle()
    await jobs.cancel(ME, key)
    await h.settle()
    (error,) = await following
    assert [c.text for c in got] == ["Once"]
    assert isinstance(error, Error) and error.code is ErrorCode.CANCELLED and error.id == 9


async def test_ended_streams_go_past_the_results_retention_and_oldest_over_the_bound(
        make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    h = make_harness(cold_start_workers=1)
    streams = JobStreams(service(h, result_retention_s=60))
    monkeypatch.setattr(jobstreams, "KEPT_BYTES", 1500)  # one ended stream of 1,000
    ended = []
    for prompt in ("a", "b"):
        key, worker, job_id = await started(h, streams, streamed(prompt))
        h.chunk(worker, job_id, 0, prompt * 1000)
        h.end(worker, job_id)
        await h.settle()
        ended.append(key)
    running, *_ = await started(h, streams, streamed("c"))  # the oldest ended one went
    assert [key in streams._kept for key in (*ended, running)] == [False, True, True]
    h.clock.advance(61)
    await streams.submit(ME, streamed("d"), 100)  # past the retention
    assert [key in streams._kept for key in (*ended, running)] == [False, False, True]


async def test_a_forgotten_jobs_stream_goes_and_its_bytes_with_it(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    streams = JobStreams(service(h))
    key, worker, job_id = await started(h, streams, streamed())
    h.chunk(worker, job_id, 0, "x" * 1000)
    h.end(worker, job_id)
    await h.settle()
    assert streams._ended_bytes > 1000
    streams.forget(key)
    assert key not in streams._kept and streams._ended_bytes == 0
    seen: list[Any] = []  # its result is still kept: followed whole, as one chunk
    whole, _ = await streams.follow(ME, Follow(id=9, key=key), seen.append)
    assert whole.text == "x" * 1000 and seen == []
