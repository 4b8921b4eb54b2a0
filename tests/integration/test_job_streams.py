"""Following a generation job's stream through a real daemon (Follow): live from any
connection, again after it ended, stopped without stopping the job; a job submitted
without `stream`, whole; what cannot be followed, refused."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, model_entry, start_daemon
from test_cli_ops import cli

from modelpool.protocol.async_client import AsyncClient
from modelpool.protocol.client import TextChunk
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.jobs import Follow
from modelpool.protocol.messages import Chunk, End, Error

TOKENS = 20  # a token each 0.05 s: a second of a job, which a follower sees running


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = start_daemon(tmp_path_factory.mktemp("followed"), f"""
        [pool]
        cold_start_workers = 1
        {model_entry("gen", loader="counting_generator", capability="text_to_text",
                     step_s=0.05, max_workers=1)}
        {model_entry("slow", run_s=0.2)}
    """)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def _texts(chunks: list[TextChunk]) -> list[str]:
    return [chunk.text for chunk in chunks]


def test_a_streamed_job_is_followed_live_and_again_once_ended(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.generate("warm", model="gen", max_tokens=1).__next__()  # loaded
        key = c.submit("generate", "Once", model="gen", max_tokens=TOKENS, stream=True)
        live = []
        for chunk in c.follow(key):
            if not live:  # the first chunk came while the job runs: it streams
                assert c.job(key)["state"] == "running"
            live.append(chunk)
        result = c.retrieve(key, timeout_s=30)
    assert "".join(_texts(live)) == result.text and len(live) > TOKENS // 2
    assert live[-1].finish_reason == "length" and live[-1].completion_tokens == TOKENS
    with daemon.client() as other:  # another connection, after the end: the same chunks
        again = list(other.follow(key))
        other.forget(key)
        with pytest.raises(PoolError) as err:
            list(other.follow(key))
    assert _texts(again) == _texts(live) and again[-1].finish_reason == "length"
    assert err.value.code is ErrorCode.RESULT_NOT_FOUND


def test_followers_side_by_side_and_one_that_stops_early(daemon: Daemon) -> None:
    async def follow_all(socket_path: str, key: str, stop_after: int | None) -> list[str]:
        async with AsyncClient(socket_path) as c:
            texts = []
            async for chunk in c.follow(key):
                texts.append(chunk.text)
                if stop_after is not None and len(texts) == stop_after:
                    break
            return texts

    async def run() -> tuple[str, list[list[str]]]:
        async with AsyncClient(daemon.socket_path) as c:
            key = await c.submit("generate", "Twice", model="gen", max_tokens=TOKENS,
                                 stream=True)
        return key, await asyncio.gather(*(follow_all(daemon.socket_path, key, stop)
                                           for stop in (None, None, 2)))

    key, (first, second, stopped) = asyncio.run(run())
    assert first == second and first[:2] == stopped and len(stopped) == 2
    with daemon.client() as c:  # the follower that stopped did not stop the job
        assert c.retrieve(key, timeout_s=30).text == "".join(first)
        assert c.job(key)["state"] == "done"


def test_a_job_submitted_without_stream_is_followed_whole(daemon: Daemon) -> None:
    with daemon.client() as c:
        key = c.submit("generate", "Whole", model="gen", max_tokens=4)
        chunks = list(c.follow(key))  # its text in one chunk, then its end
        assert _texts(chunks) == [c.retrieve(key, timeout_s=30).text, ""]
        assert chunks[-1].finish_reason == "length"


def test_a_cancelled_job_ends_its_followers_stream_cancelled(daemon: Daemon) -> None:
    with daemon.client() as c:
        key = c.submit("generate", "Stop", model="gen", max_tokens=200, stream=True)
        stream = c.follow(key)
        assert next(stream).text
        def cancel_it() -> None:
            with daemon.client() as other:
                other.cancel(key)

        cancel = threading.Timer(0.2, cancel_it)
        cancel.start()
        with pytest.raises(PoolError) as err:
            for _ in stream:
                pass
        cancel.join()
    assert err.value.code is ErrorCode.CANCELLED


def test_what_cannot_be_followed(daemon: Daemon) -> None:
    with daemon.client() as c:
        key = c.submit("embed", "no stream", model="slow", stream=True)
        with pytest.raises(PoolError) as err:
            list(c.follow(key))
        assert err.value.code is ErrorCode.BAD_REQUEST and "embed" in err.value.message
        with pytest.raises(PoolError) as err:
            list(c.follow("0" * 32))
        assert err.value.code is ErrorCode.RESULT_NOT_FOUND
        assert c.embed("after", model="slow")[0] == 5.0  # the connection goes on


def test_a_follows_id_is_in_flight_until_its_end(daemon: Daemon) -> None:
    """A second request with the id of a follow still streaming would read as its
    replies: it is refused (with no id), and the follow goes on to its end."""
    with daemon.client() as c:
        key = c.submit("generate", "Twice", model="gen", max_tokens=TOKENS, stream=True)
        c._send(Follow(id=77, key=key))
        c._send(Follow(id=77, key=key))
        replies = []
        while not replies or type(replies[-1]) is Chunk or replies[-1].id is None:
            replies.append(c._next(77))  # to the follow's final reply
    refused = [r for r in replies if isinstance(r, Error)]
    assert len(refused) == 1 and refused[0].id is None
    assert "already in flight" in refused[0].message
    assert type(replies[-1]) is End and replies[-1].completion_tokens == TOKENS


def test_following_needs_no_open_submitter(daemon: Daemon, tmp_path: Path) -> None:
    with daemon.client() as c:
        key = c.submit("generate", "Gone", model="gen", max_tokens=TOKENS, stream=True)
    with daemon.client() as c:  # the submitter's connection closed at once
        chunks = list(c.follow(key))
    assert chunks[-1].completion_tokens == TOKENS and len(chunks) > 1


def test_the_cli_submits_a_streamed_job_and_follows_it(daemon: Daemon) -> None:
    def out(*args: str) -> str:
        run = cli(daemon, *args)
        assert run.returncode == 0, run.stderr
        return run.stdout

    key = out("submit", "generate", "Once", "--model", "gen", "--max-tokens", "6",
              "--stream").strip()
    lines = [json.loads(line) for line in out("follow", key, "--json").splitlines()]
    assert "".join(line.get("text", "") for line in lines) == "".join(
        f"tok{i} " for i in range(6))
    assert len(lines) > 2 and lines[-1]["finish_reason"] == "length"
    assert out("follow", key) == "".join(f"tok{i} " for i in range(6)) + "\n"
