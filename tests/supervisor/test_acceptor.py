"""Accepting clients: how many an fd limit allows, and accept errors logged once per
period, not once per failure."""

from __future__ import annotations

import errno
import logging

import pytest
from conftest import FakeScheduler

from modelpool.supervisor.acceptor import Acceptor, auto_max_connections


@pytest.mark.parametrize(("limit", "allowed"), [(256, 128), (512, 384), (1024, 768),
                                                (100, 1), (1 << 20, 4096)])
def test_connections_allowed_by_an_fd_limit(limit: int, allowed: int) -> None:
    assert auto_max_connections(limit) == allowed


def test_accept_failures_are_logged_once_per_period(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeScheduler()  # (its timers are not needed here)
    acceptor = Acceptor(None, clock, lambda sock: True, lambda: b"")  # type: ignore[arg-type]
    failure = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.WARNING, logger="modelpool.server"):
        for _ in range(1000):
            acceptor._note_failure(failure)
            clock.advance(0.01)
        clock.advance(0.1)
        acceptor._note_failure(failure)
    assert len(caplog.records) == 2
    assert "more since" in caplog.records[1].getMessage()
