"""Clients that hoard: replies they never read (paused, then dropped, within a total),
connections beyond the daemon's file descriptors (refused politely, the log quiet)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from adversarial_helpers import (
    Daemon,
    closed_within,
    fd_limited_daemon,
    greeted,
    model_entry,
    raw_connection,
    reply,
    rss_mb,
    running_daemon,
    send_msg,
)

from modelpool.protocol.client import Client, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import Embed, Embeddings, ListModels, ModelsReply

MB = 2**20
BIG = """
[[models]]
key = "big"
capability = "text_embedding"
loader = "mp_test_loaders:slow_embedder"
options = { run_s = 1.0 }
max_workers = 1
max_batch = 4096
"""


def unread_bytes(daemon: Daemon) -> int:
    with daemon.client() as c:
        return c.status()["clients"]["unread_reply_bytes"]


def test_unread_replies_are_capped_in_total(tmp_path: Path) -> None:
    """8 clients that never read, 7.5 MB of replies each (128 KiB apiece), against a cap of
    8 MiB in all: the biggest hoarders are dropped, the daemon holds at most the cap."""
    cap = 8 * MB
    with running_daemon(tmp_path, f"[daemon]\nmax_unread_total_bytes = {cap}\n" + BIG) as daemon:
        with daemon.client() as c:
            c.embed("warm", model="big")
        before = rss_mb(daemon.process.pid)
        hoarders = [greeted(daemon.socket_path) for _ in range(8)]
        texts = ["x"] * 4096
        for sock in hoarders:  # read before the model answers: nothing backs up yet
            for rid in range(60):
                send_msg(sock, Embed(id=rid, model="big", texts=texts))
        peak_unread, peak_rss = 0, before
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            peak_unread = max(peak_unread, unread_bytes(daemon))
            peak_rss = max(peak_rss, rss_mb(daemon.process.pid))
            time.sleep(0.1)
        with daemon.client() as c:
            assert c.embed("polite", model="big").shape == (8,)
        dropped = sum(closed_within(sock, 1)[1] is not None for sock in hoarders)
    assert peak_unread <= cap, peak_unread
    assert 1 <= dropped < 8, dropped
    assert peak_rss - before < 40, (before, peak_rss)  # 60 MB of replies were asked for


def test_a_client_that_does_not_read_is_paused_and_loses_nothing(tmp_path: Path) -> None:
    """Its requests stay unread while its replies back up; once it reads, all come."""
    with running_daemon(tmp_path, model_entry("fast", run_s=0)) as daemon:
        requests = 20_000
        sock = greeted(daemon.socket_path, timeout_s=60)
        sender = threading.Thread(target=_send_list_models, args=(sock, requests), daemon=True)
        sender.start()
        time.sleep(2)
        held = unread_bytes(daemon)
        assert sender.is_alive()  # the daemon stopped reading: the client's sends block
        got = sum(isinstance(reply(sock), ModelsReply) for _ in range(requests))
        sender.join(30)
        sock.close()
    assert held < 2 * MB, held  # without the pause: every reply, ~10 MB here
    assert got == requests


def _send_list_models(sock: socket.socket, count: int) -> None:
    for rid in range(count):
        send_msg(sock, ListModels(id=rid))


def test_clients_beyond_max_connections_are_refused_politely(tmp_path: Path) -> None:
    with running_daemon(tmp_path, "[daemon]\nmax_connections = 4\n"
                        + model_entry("fast", run_s=0)) as daemon:
        held = [greeted(daemon.socket_path) for _ in range(4)]
        with pytest.raises(PoolError) as refused:
            Client(socket_path=daemon.socket_path, timeout_s=5)
        assert refused.value.code is ErrorCode.OVERLOADED
        assert refused.value.retry_after_s == 1.0
        send_msg(held[0], Embed(id=1, model="fast", texts=["held"]))
        assert isinstance(reply(held[0]), Embeddings)  # the admitted ones are untouched
        held.pop().close()
        time.sleep(0.3)
        with daemon.client() as c:
            assert c.embed("a free slot", model="fast").shape == (8,)
        for sock in held:
            sock.close()


def test_out_of_file_descriptors_the_daemon_refuses_and_the_log_stays_quiet(
        tmp_path: Path) -> None:
    """300 idle connections under a 256-fd limit: asyncio's accept loop wrote thousands of
    traceback lines a second; now the cap (256 - 128 reserved = 128) refuses the rest."""
    with fd_limited_daemon(tmp_path, model_entry("fast", run_s=0), nofile=256) as daemon:
        idle = [raw_connection(daemon.socket_path) for _ in range(300)]
        time.sleep(3)
        closed = told = 0
        for sock in idle:
            got, seconds = closed_within(sock, 0.01)
            closed += seconds is not None
            told += any(getattr(m, "code", None) is ErrorCode.OVERLOADED for m in got)
        log_lines = daemon.log().count("\n")
        with pytest.raises(PoolError) as full:
            Client(socket_path=daemon.socket_path, timeout_s=5)
        assert full.value.code is ErrorCode.OVERLOADED
        for sock in idle:
            sock.close()
        time.sleep(0.5)
        with daemon.client() as c:  # workers still start under the limit
            assert c.embed("room again", model="fast").shape == (8,)
    assert closed >= 300 - 128 - 10, closed  # refused (some told why; none sent a hello)
    assert told > 0
    assert log_lines < 20, daemon.log()[-3000:]
