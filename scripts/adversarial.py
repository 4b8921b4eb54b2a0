#!/usr/bin/env python
"""What hostile or careless clients cost the daemon's front door: a real daemon, fed
fuzzed frames, a frame-sized bomb and clients that never read their replies.

Prints one JSON object: supervisor RSS before and after 10,000 fuzzed frames (target
+20 MB at most), RSS after and during one max-size bomb frame (target: at most twice
the frame), the time to the reply to a bad frame (target p99 10 ms), the unread
replies held for clients that never read (bounded by max_unread_total_bytes), the
log lines written while 600 idle connections meet a 512-fd limit; and, from
scripts/adversarial_pool.py, the split of dispatches between a flooding and a polite
client (target: the polite one >= 40 %), a SIGSTOPped busy worker until its request is
answered (target heartbeat_timeout_s + 0.5 s) and a stop with a hung worker until the
daemon has exited (target shutdown_timeout_s + 1 s).

    python scripts/adversarial.py            # ~3 minutes on 2 cores
    python scripts/adversarial.py --frames 2000
    python scripts/adversarial.py --only pool --trials 1

The fuzz corpus is scripts/fuzz_frames.py, shared with tests/adversarial/.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from adversarial_pool import pool_figures  # noqa: E402
from bench import Daemon, percentiles  # noqa: E402
from fuzz_frames import bomb_frame, fuzzed_frames  # noqa: E402

from modelpool.protocol.client import Client, PoolError  # noqa: E402
from modelpool.protocol.framing import HEADER, recv_frame, send_frame  # noqa: E402
from modelpool.protocol.messages import (  # noqa: E402
    Embed,
    Embeddings,
    Error,
    Hello,
    encoder,
)
from modelpool.protocol.wire import server_decoder  # noqa: E402

MB = 2**20
NOOP = """
[[models]]
key = "noop"
capability = "text_embedding"
loader = "bench_loaders:noop"
max_batch = 4096
max_queue = 100000

[[models]]
key = "slow"
capability = "text_embedding"
loader = "bench_loaders:noop"
options = { run_s = 1.0 }
max_batch = 4096
max_queue = 100000
"""

# ---- the daemon's side ----------------------------------------------------------------


def greeted(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    send_frame(sock, encoder.encode(Hello(protocol_version=1)))
    server_decoder.decode(recv_frame(sock))
    return sock


def rss_mb(daemon: Daemon) -> float:
    return round(psutil.Process(daemon.process.pid).memory_info().rss / MB, 1)


class PeakRss:
    """The supervisor's highest RSS while the block runs, sampled every 2 ms."""

    def __init__(self, daemon: Daemon) -> None:
        self.process = psutil.Process(daemon.process.pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def fuzz_figures(daemon: Daemon, frames: int) -> dict[str, Any]:
    sock = greeted(daemon.socket)
    good = encoder.encode(Embed(id=1, model="noop", texts=["warm"]))
    send_frame(sock, good)
    recv_frame(sock)
    before = rss_mb(daemon)
    times, wrong = [], 0
    for payload, rid in fuzzed_frames(frames):
        sock.sendall(HEADER.pack(len(payload)) + payload)
        t0 = time.perf_counter()
        msg = server_decoder.decode(recv_frame(sock))
        times.append(time.perf_counter() - t0)
        wrong += not (isinstance(msg, Error) and msg.code == "BAD_REQUEST"
                      and (rid is None or msg.id == rid))
    send_frame(sock, good)
    still_serves = isinstance(server_decoder.decode(recv_frame(sock)), Embeddings)
    sock.close()
    time.sleep(0.5)
    return {"frames": frames, "rss_before_mb": before, "rss_after_mb": rss_mb(daemon),
            "rss_growth_mb": round(rss_mb(daemon) - before, 1),
            "bad_frame_reply": percentiles(times), "replies_not_as_expected": wrong,
            "connection_still_serves": still_serves}


def bomb_figures(daemon: Daemon, limit: int) -> dict[str, Any]:
    payload = bomb_frame(limit)
    sock = greeted(daemon.socket)
    before = rss_mb(daemon)
    with PeakRss(daemon) as peak:
        sock.sendall(HEADER.pack(len(payload)) + payload)
        t0 = time.perf_counter()
        msg = server_decoder.decode(recv_frame(sock))
        elapsed = time.perf_counter() - t0
        time.sleep(0.3)
    sock.close()
    return {"frame_mb": round(len(payload) / MB, 1), "rss_before_mb": before,
            "rss_peak_mb": round(peak.peak / MB, 1), "rss_after_mb": rss_mb(daemon),
            "reply_ms_after_sending": round(elapsed * 1000, 1),
            "reply": f"{msg.code} id={msg.id}" if isinstance(msg, Error) else repr(msg)[:80]}


def unread_figures(daemon: Daemon, clients: int, requests: int) -> dict[str, Any]:
    """Clients that send big-reply requests and never read: what the daemon holds. The
    model takes a second, so every request is read before any reply backs up."""
    texts = ["x"] * 4096  # replies of 64 KiB
    socks = [greeted(daemon.socket) for _ in range(clients)]
    before = rss_mb(daemon)

    def flood(sock: socket.socket) -> None:
        sock.settimeout(3)  # the daemon stops reading a client whose replies back up
        try:
            for rid in range(1, requests + 1):
                send_frame(sock, encoder.encode(Embed(id=rid, model="slow", texts=texts)))
        except OSError:
            pass

    threads = [threading.Thread(target=flood, args=(s,), daemon=True) for s in socks]
    peak_unread, peak_rss = 0, before
    with Client(socket_path=daemon.socket) as polite:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            clients_status = polite.status().get("clients") or {}
            peak_unread = max(peak_unread, clients_status.get("unread_reply_bytes", 0))
            peak_rss = max(peak_rss, rss_mb(daemon))
            time.sleep(0.05)
        time.sleep(1)
        clients_status = polite.status().get("clients") or {}
        polite_ok = polite.embed("still served", model="noop").shape == (4,)
    dropped = sum(_dropped(s) for s in socks)
    return {"clients": clients, "requests_each": requests, "reply_kib": 64,
            "unread_peak_mb": round(peak_unread / MB, 1),
            "unread_at_end_mb": round(clients_status.get("unread_reply_bytes", 0) / MB, 1),
            "cap_mb": round(clients_status.get("max_unread_total_bytes", 0) / MB, 1),
            "rss_before_mb": before, "rss_peak_mb": peak_rss, "clients_dropped": dropped,
            "polite_client_served": polite_ok}


def fd_exhaustion_figures(idle: int, nofile: int, seconds: float) -> dict[str, Any]:
    """idle connections (no hello) to a daemon under RLIMIT_NOFILE = nofile: the log lines
    written meanwhile (asyncio's accept loop wrote ~14,000 a second), the client turned
    away, and whether clients are served once the idle ones are gone."""
    daemon = Daemon(NOOP)
    try:
        # Set before the daemon has finished importing (it raises soft to hard at start).
        resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
        daemon.wait_listening()
        log = daemon.dir / "log"
        lines_before = log.read_text().count("\n")
        socks = []
        for _ in range(idle):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(daemon.socket)
            socks.append(sock)
        time.sleep(seconds)
        try:
            with Client(socket_path=daemon.socket, timeout_s=5) as c:
                turned_away = f"served: {c.status()['clients']}"
        except PoolError as exc:
            turned_away = str(exc)
        lines = log.read_text().count("\n") - lines_before
        for sock in socks:
            sock.close()
        time.sleep(0.5)
        with Client(socket_path=daemon.socket, timeout_s=10) as c:
            served_after = c.embed("x", model="noop").shape == (4,)
    finally:
        daemon.stop()
    return {"idle_connections": idle, "nofile": nofile, "seconds": seconds,
            "log_lines": lines, "new_client_got": turned_away,
            "served_once_they_left": served_after}


def _dropped(sock: socket.socket) -> bool:
    """Read what the daemon kept for this client; True if it then closed the connection."""
    sock.settimeout(0.5)
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--only", choices=("front", "pool"),
                        help="front: frames, replies and fds; pool: fairness, hangs, stops")
    parser.add_argument("--seconds", type=float, default=8.0, help="each fairness window")
    parser.add_argument("--trials", type=int, default=3, help="of each hang and stop")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {}
    if args.only != "pool":
        figures.update(front_figures(args.frames))
    if args.only != "front":
        figures["pool"] = pool_figures(args.seconds, args.trials)
    print(json.dumps(figures, indent=2))
    return 0


def front_figures(frames: int) -> dict[str, Any]:
    limit = 64 * MB
    daemon = Daemon(f"[daemon]\nmax_frame_bytes = {limit}\n"
                    "[pool]\nmax_queued_total = 100000\n" + NOOP)
    try:
        daemon.wait_listening()
        figures = {"fuzz": fuzz_figures(daemon, frames),
                   "bomb": bomb_figures(daemon, limit),
                   "unread_replies": unread_figures(daemon, clients=16, requests=300)}
    finally:
        daemon.stop()
    figures["fd_exhaustion"] = fd_exhaustion_figures(idle=600, nofile=512, seconds=20)
    return figures


if __name__ == "__main__":
    sys.exit(main())
