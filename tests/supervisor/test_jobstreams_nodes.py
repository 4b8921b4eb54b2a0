"""A streamed job followed through another node of a cluster, with fakes for PostgreSQL's
channels: the node that keeps its stream sends it, between marks, under the asker's key,
from the first piece and then live; the asker makes the same chunks of it; a keeper that
keeps none, or is silent, leaves the job to come whole once it has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from test_jobservice import ME, service
from test_jobstreams import started, streamed

from modelpool.protocol.jobs import Follow
from modelpool.protocol.messages import Chunk, End
from modelpool.supervisor import jobstreams
from modelpool.supervisor.jobservice import JobService
from modelpool.supervisor.jobstreams import JobStreams
from modelpool.supervisor.pgstreams import (
    RelayedStreams,
    StreamFollowers,
    StreamPiece,
    payloads,
)

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]
HERE, THERE = "channel-here", "channel-there"


class Channels:
    """PostgreSQL's notifications as this node's publisher sends them: what it sends to
    its own channel comes back to its followers; the rest is kept, by channel."""

    def __init__(self, followers: StreamFollowers) -> None:
        self.followers = followers
        self.sent: dict[str, list[str]] = {}

    def publish(self, channel: str, piece: StreamPiece) -> None:
        for payload in payloads(piece):
            self.publish_text(channel, payload)

    def publish_text(self, channel: str, payload: str) -> None:
        if channel == HERE:
            self.followers.notified(payload)
        else:
            self.sent.setdefault(channel, []).append(payload)


def clustered(h: Harness) -> tuple[JobService, Channels]:
    jobs = service(h)
    followers = StreamFollowers()
    channels = Channels(followers)
    jobs.streams = RelayedStreams(HERE, followers, channels)  # type: ignore[arg-type]
    return jobs, channels


async def run_here(h: Harness, text: str) -> None:
    """The job runs on this node's worker: its text in one chunk, then its end."""
    (worker,) = h.workers("gen")
    h.ready(worker)
    await h.settle()
    (job_id,) = h.job_ids(worker)
    h.chunk(worker, job_id, 0, text)
    h.end(worker, job_id)


async def test_the_keeper_sends_what_it_kept_then_the_rest_live_between_marks(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs, channels = clustered(h)
    streams = JobStreams(jobs)
    key, worker, job_id = await started(h, streams, streamed())
    h.chunk(worker, job_id, 0, "Once")
    await h.settle()
    jobs.streams.followers.notified(f"? {key} {key}.r1 {THERE}")  # type: ignore[union-attr]
    jobs.streams.followers.notified(f"? no-such-job no-such-job.r2 {THERE}")  # type: ignore
    await h.settle()
    assert "! no-such-job.r2 none" in channels.sent[THERE]

    def to_r1() -> list[str]:
        return [p for p in channels.sent[THERE] if f"{key}.r1" in p]

    assert to_r1() == [f"! {key}.r1 begin", f"{key}.r1 0 0 Once"]
    h.chunk(worker, job_id, 1, " upon")
    h.end(worker, job_id)
    await h.settle()
    assert to_r1()[2:] == [f"{key}.r1 0 4  upon", f"! {key}.r1 end"]


async def test_a_follow_here_takes_the_keepers_pieces_as_the_chunks_it_made(
        make_harness: MakeHarness) -> None:
    h = make_harness(cold_start_workers=1)
    jobs, channels = clustered(h)
    key = await jobs.submit(ME, streamed(), 100, stream_to=THERE)  # kept over there
    got: list[Any] = []
    following = asyncio.ensure_future(JobStreams(jobs).follow(ME, Follow(id=9, key=key),
                                                              got.append))
    await h.settle()
    (asked,) = channels.sent[THERE]
    _, job, reply_key, channel = asked.split(" ")
    assert (job, channel) == (key, HERE)
    for payload in (f"! {reply_key} begin", f"{reply_key} 1 0 Once", f"{reply_key} 1 4  upon"):
        jobs.streams.followers.notified(payload)  # type: ignore[union-attr]
        await h.settle()
    assert [(c.seq, c.text) for c in got] == [(0, "Once"), (1, " upon")]  # as they come
    await run_here(h, "Once upon")
    jobs.streams.followers.notified(f"! {reply_key} end")  # type: ignore[union-attr]
    (end,) = await following
    assert isinstance(end, End) and end.id == 9 and all(isinstance(c, Chunk) for c in got)


@pytest.mark.parametrize("answer", ["none", None])  # keeps none of it / silent (gone)
async def test_without_the_keepers_pieces_the_job_comes_whole_once_ended(
        make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch, answer: str | None) -> None:
    monkeypatch.setattr(jobstreams, "KEEPER_WAIT_S", 0.05)
    h = make_harness(cold_start_workers=1)
    jobs, channels = clustered(h)
    key = await jobs.submit(ME, streamed(), 100, stream_to=THERE)
    following = asyncio.ensure_future(JobStreams(jobs).follow(ME, Follow(id=9, key=key),
                                                              lambda chunk: None))
    await h.settle()
    if answer is not None:
        reply_key = channels.sent[THERE][0].split(" ")[2]
        jobs.streams.followers.notified(f"! {reply_key} {answer}")  # type: ignore[union-attr]
    await asyncio.sleep(0.1)
    await run_here(h, "Once upon")
    chunk, end = await following
    assert (chunk.text, chunk.id, end.finish_reason) == ("Once upon", 9, "stop")


async def test_a_follower_that_leaves_first_stops_the_keeper_sending(
        make_harness: MakeHarness) -> None:
    """Else a client that follows and leaves again and again through another node would
    have the keeper send the whole stream once more each time, to the job's end."""
    h = make_harness(cold_start_workers=1)
    jobs, channels = clustered(h)
    streams = JobStreams(jobs)
    key, worker, job_id = await started(h, streams, streamed())
    followers = jobs.streams.followers  # type: ignore[union-attr]
    followers.notified(f"? {key} {key}.r1 {THERE}")
    h.chunk(worker, job_id, 0, "Once")
    await h.settle()
    followers.notified(f"x {key}.r1")
    await h.settle()
    h.chunk(worker, job_id, 1, " upon")
    h.end(worker, job_id)
    await h.settle()
    assert channels.sent[THERE] == [f"! {key}.r1 begin", f"{key}.r1 0 0 Once"]  # no more
    # The follower's side: its client leaves while the keeper sends
    key = await jobs.submit(ME, streamed(), 100, stream_to=THERE)
    following = asyncio.ensure_future(streams.follow(ME, Follow(id=9, key=key),
                                                     lambda chunk: None))
    await h.settle()
    reply_key = channels.sent[THERE][-1].split(" ")[2]
    followers.notified(f"! {reply_key} begin")
    await h.settle()
    following.cancel()
    await h.settle()
    assert channels.sent[THERE][-1] == f"x {reply_key}"
