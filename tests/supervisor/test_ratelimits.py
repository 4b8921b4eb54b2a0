"""Each HTTP client's requests a minute: a bucket of a minute's requests that fills at
that rate, pure over the time given."""

from __future__ import annotations

from modelpool.supervisor.httpapi.ratelimits import RateLimits


def test_a_minutes_requests_at_once_then_one_as_each_comes_back() -> None:
    limits = RateLimits()
    taken = [limits.take("key-a", 60, 100.0) for _ in range(61)]
    assert [t.allowed for t in taken] == [True] * 60 + [False]
    refused = taken[-1]
    assert (refused.remaining, refused.retry_after_s) == (0, 1.0)
    assert refused.headers(60) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "60.000s", "retry-after": "1", "retry-after-ms": "1000"}
    assert limits.take("key-b", 60, 100.0).allowed  # another client's own bucket
    assert not limits.take("key-a", 60, 100.5).allowed  # half a request back
    again = limits.take("key-a", 60, 101.0)
    assert again.allowed and again.remaining == 0 and "retry-after" not in again.headers(60)
    assert limits.take("key-a", 60, 200.0).remaining == 59  # full again, then one taken


def test_a_slower_limit_waits_longer_and_a_lower_one_takes_effect_at_once() -> None:
    limits = RateLimits()
    assert limits.take("k", 2, 0.0).allowed and limits.take("k", 2, 0.0).allowed
    refused = limits.take("k", 2, 10.0)  # a third of a request back: 20 s to go
    assert not refused.allowed and round(refused.retry_after_s, 6) == 20.0
    assert refused.headers(2)["retry-after"] == "20"
    limits.take("j", 100, 0.0)
    assert limits.take("j", 1, 0.0).remaining == 0  # a reload's lower limit caps the bucket


def test_only_the_clients_seen_last_are_kept_and_one_dropped_starts_full() -> None:
    limits = RateLimits(max_clients=2)
    for who in ("a", "b"):
        limits.take(who, 1, 0.0)
    assert not limits.take("a", 1, 0.0).allowed  # kept: empty ("a" seen last now)
    limits.take("c", 1, 0.0)  # "b" goes
    assert limits.take("b", 1, 0.0).allowed  # starts full, as a minute's wait would give
    assert not limits.take("c", 1, 0.0).allowed
