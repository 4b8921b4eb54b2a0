"""`[http] requests_per_minute` through a real daemon and the official openai package: a
key's minute of requests, then 429 with OpenAI's headers, which the SDK waits out and
retries; other keys untouched; a reload changes the limit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import Daemon, start_daemon
from http_helpers import free_port, wait_for_http

KEYS = ("key-of-team-a-0123456789", "key-of-team-b-0123456789")
CONFIG = """
    [http]
    listen = "127.0.0.1:{port}"
    api_keys = ["{a}", "{b}"]
    requests_per_minute = {limit}
"""


def sdk(base: str, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=retries, timeout=30)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Daemon, str, Path]]:
    port = free_port()
    daemon = start_daemon(tmp_path, CONFIG.format(port=port, a=KEYS[0], b=KEYS[1], limit=60))
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)
    yield daemon, base, tmp_path / "modelpool.toml"
    assert daemon.stop() == 0, daemon.log()


def test_a_keys_minute_of_requests_then_429_which_the_sdk_waits_out(
        served: tuple[Daemon, str, Path]) -> None:
    daemon, base, config = served
    team_a = sdk(base, KEYS[0])
    for _ in range(60):
        team_a.models.list()
    with pytest.raises(openai.RateLimitError) as refused:
        team_a.models.list()
    error = refused.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    headers = error.response.headers
    assert (headers["retry-after"], headers["x-ratelimit-limit-requests"],
            headers["x-ratelimit-remaining-requests"]) == ("1", "60", "0")
    answered = sdk(base, KEYS[1]).with_raw_response.models.list()  # another key: its own
    assert answered.headers["x-ratelimit-remaining-requests"] == "59"
    started = time.monotonic()
    sdk(base, KEYS[0], retries=2).models.list()  # the SDK waits as told, then it is served
    assert time.monotonic() - started > 0.3
    config.write_text(config.read_text().replace("requests_per_minute = 60",
                                                 "requests_per_minute = 0"))
    with daemon.client() as c:
        assert "[http] applied" in c.reload()
    for _ in range(5):
        answered = team_a.with_raw_response.models.list()  # no limit now
    assert "x-ratelimit-limit-requests" not in answered.headers
