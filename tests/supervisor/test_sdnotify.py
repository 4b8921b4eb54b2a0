"""systemd's notify protocol against a real datagram socket; its timing on a fake clock."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeScheduler

from modelpool.supervisor import sdnotify
from modelpool.supervisor.sdnotify import Notifier, ServiceNotifier


class Listener:
    """The service manager's end: a bound AF_UNIX datagram socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)

    def messages(self) -> list[str]:
        """Every datagram that has arrived, in order."""
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return out

    def fields(self) -> list[str]:
        return [line for msg in self.messages() for line in msg.split("\n")]


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    listener = Listener(str(tmp_path / "notify"))
    yield listener
    listener.sock.close()


def service(listener: Listener, clock: FakeScheduler, watchdog_s: float | None = 0.2,
            status: str = "2 model(s) loaded") -> ServiceNotifier:
    return ServiceNotifier(Notifier(listener.sock.getsockname()), clock, lambda: status,
                           watchdog_s)


def test_addresses_paths_and_the_abstract_namespace() -> None:
    assert sdnotify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.socket_address("@sd-notify-1") == "\0sd-notify-1"
    assert sdnotify.socket_address("vsock:2:1234") is None
    assert sdnotify.socket_address("") is None
    assert sdnotify.socket_address("@") is None


def test_watchdog_interval_is_half_the_timeout_and_only_for_us() -> None:
    assert sdnotify.watchdog_interval_s("400000", None, 42) == pytest.approx(0.2)
    assert sdnotify.watchdog_interval_s("400000", "42", 42) == pytest.approx(0.2)
    assert sdnotify.watchdog_interval_s("400000", "43", 42) is None  # another process's
    assert sdnotify.watchdog_interval_s(None, None, 42) is None
    assert sdnotify.watchdog_interval_s("0", None, 42) is None
    assert sdnotify.watchdog_interval_s("soon", None, 42) is None


def test_a_datagram_reaches_a_path_socket(listener: Listener) -> None:
    notifier = Notifier(listener.sock.getsockname())
    assert notifier.send("READY=1", "STATUS=hello")
    assert listener.messages() == ["READY=1\nSTATUS=hello"]
    notifier.close()


def test_a_datagram_reaches_an_abstract_socket() -> None:
    name = f"modelpool-test-{os.getpid()}-{id(object())}"
    listener = Listener("\0" + name)
    try:
        env = {"NOTIFY_SOCKET": "@" + name}
        notifier = ServiceNotifier.from_environ(FakeScheduler(), lambda: "up", env)
        notifier.ready()
        assert listener.messages() == ["READY=1\nSTATUS=up"]
        notifier.close()
    finally:
        listener.sock.close()


def test_nothing_is_sent_and_nothing_armed_without_a_socket() -> None:
    clock = FakeScheduler()
    env = {"WATCHDOG_USEC": "400000"}
    notifier = ServiceNotifier.from_environ(clock, lambda: "up", env)
    notifier.ready()
    notifier.stopping(5)
    assert not notifier.notifier.enabled
    assert clock.pending() == 0
    assert Notifier(None).send("READY=1") is False


def test_the_variables_leave_the_environment(listener: Listener) -> None:
    env = {"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": "400000",
           "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
    notifier = ServiceNotifier.from_environ(FakeScheduler(), lambda: "up", env)
    assert env == {"PATH": "/bin"}  # children (forkserver, workers) inherit none of them
    assert notifier.watchdog_s == pytest.approx(0.2)


def test_a_watchdog_meant_for_another_process_is_not_fed(listener: Listener) -> None:
    env = {"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": "400000",
           "WATCHDOG_PID": str(os.getpid() + 1)}
    clock = FakeScheduler()
    notifier = ServiceNotifier.from_environ(clock, lambda: "up", env)
    notifier.ready()
    clock.advance(2)
    assert "WATCHDOG=1" not in listener.fields()


def test_a_vanished_manager_costs_nothing(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "gone"))
    assert notifier.send("READY=1") is False  # ENOENT: logged, not raised
    assert notifier.send("WATCHDOG=1") is False


def test_nothing_before_ready_then_ready_with_status(listener: Listener) -> None:
    clock = FakeScheduler()
    notifier = service(listener, clock)
    clock.advance(10)
    assert listener.messages() == []
    notifier.ready()
    messages = listener.messages()
    assert messages[0] == "READY=1\nSTATUS=2 model(s) loaded"
    assert messages[1:] == ["WATCHDOG=1"]


def advance_and_read(clock: FakeScheduler, listener: Listener, seconds: float) -> list[str]:
    """The fields sent while the clock moves on, read every second as systemd would (a
    datagram socket queues only a few: net.unix.max_dgram_qlen, 10 by default)."""
    fields = []
    for _ in range(round(seconds)):
        clock.advance(1.0)
        fields += listener.fields()
    return fields


def test_watchdog_at_its_interval_and_status_every_few_seconds(listener: Listener) -> None:
    clock = FakeScheduler()
    notifier = service(listener, clock, watchdog_s=0.25)
    notifier.ready()
    listener.messages()
    clock.advance(1.0)
    assert listener.messages() == ["WATCHDOG=1"] * 4
    fields = advance_and_read(clock, listener, 2 * sdnotify.STATUS_EVERY_S)
    assert fields.count("STATUS=2 model(s) loaded") == 2
    assert fields.count("WATCHDOG=1") == 2 * sdnotify.STATUS_EVERY_S / 0.25


def test_stopping_then_extensions_while_the_drain_runs(listener: Listener) -> None:
    clock = FakeScheduler()
    notifier = service(listener, clock, watchdog_s=None)
    notifier.ready()
    listener.messages()
    notifier.stopping(drain_s=3.0)
    extend = f"EXTEND_TIMEOUT_USEC={int(sdnotify.EXTEND_BY_S * 1e6)}"
    assert listener.messages() == ["STOPPING=1\nSTATUS=2 model(s) loaded", extend]
    assert advance_and_read(clock, listener, 3.0).count(extend) == 3
    # Only until the drain's end and one extension more: a stop that never ends is
    # still cut short by systemd.
    later = advance_and_read(clock, listener, 60)
    assert later.count(extend) == sdnotify.EXTEND_BY_S / sdnotify.EXTEND_EVERY_S - 1
    assert set(later) == {extend, "STATUS=2 model(s) loaded"}  # status goes on


def test_reloading_then_ready_again(listener: Listener) -> None:
    notifier = service(listener, FakeScheduler(), watchdog_s=None)
    notifier.ready()
    listener.messages()
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    notifier.reloaded()
    reloading, ready = listener.messages()
    first, stamp, status = reloading.split("\n")
    assert (first, status) == ("RELOADING=1", "STATUS=reloading the config")
    assert stamp.startswith("MONOTONIC_USEC=") and int(stamp.split("=")[1]) >= before
    assert ready == "READY=1\nSTATUS=2 model(s) loaded"


def test_close_stops_every_timer(listener: Listener) -> None:
    clock = FakeScheduler()
    notifier = service(listener, clock, watchdog_s=0.2)
    notifier.ready()
    notifier.stopping(drain_s=10)
    notifier.close()
    listener.messages()
    clock.advance(30)
    assert listener.messages() == []
    assert clock.pending() == 0
