"""systemd's notify protocol (sd_notify(3)) with no library: one datagram of
`KEY=value` lines to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or "@name" in
the abstract namespace). Without $NOTIFY_SOCKET every call does nothing.

What the daemon says, and when (`ServiceNotifier`):
- `READY=1` once its socket accepts clients (Type=notify: systemd starts what comes
  after the unit, and `systemctl start` returns, only then);
- `STATUS=...` every STATUS_EVERY_S: models loaded, workers, queue depth, clients
  (`systemctl status` shows the last one);
- `WATCHDOG=1` every half of $WATCHDOG_USEC (WatchdogSec=), from a timer on the event
  loop itself: a loop that is wedged sends nothing, and systemd kills and restarts the
  daemon. Only when $WATCHDOG_PID is unset or this process's pid;
- `RELOADING=1` when a reload (SIGHUP) starts and `READY=1` when it is done;
- `STOPPING=1` when the drain starts, then `EXTEND_TIMEOUT_USEC=` every EXTEND_EVERY_S
  while it runs, so a drain longer than TimeoutStopSec= is not cut short, but a stop
  whose loop has wedged still is, EXTEND_BY_S later.

The variables are taken out of the environment once read: the forkserver and the
workers inherit nothing that would make them look like the service to systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, MutableMapping

from modelpool.supervisor.clock import Scheduler, Timer

log = logging.getLogger("modelpool.sdnotify")

STATUS_EVERY_S = 5.0
EXTEND_EVERY_S = 1.0  # while draining
EXTEND_BY_S = 5.0  # each extension: a few missed ones before systemd gives up
ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def socket_address(value: str) -> str | None:
    """The address of $NOTIFY_SOCKET for sendto: a path, or "@name" as the abstract
    name "\\0name". None for what this module cannot send to (vsock:, empty)."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(usec: str | None, watchdog_pid: str | None, pid: int) -> float | None:
    """How often to send WATCHDOG=1: half the watchdog timeout, as sd_watchdog_enabled(3)
    advises. None without a watchdog, or when it is meant for another process."""
    if not usec:
        return None
    if watchdog_pid and watchdog_pid.strip() != str(pid):
        return None
    try:
        timeout_us = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a number of microseconds", usec)
        return None
    return timeout_us / 2e6 if timeout_us > 0 else None


class Notifier:
    """Sends notify datagrams; never blocks and never raises (a missed message costs
    less than a stalled loop). A no-op without an address."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._warned = False
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        """One datagram of these `KEY=value` fields; True if it left."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as exc:
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(level, "could not notify systemd (%s): %s", fields[0], exc)
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ServiceNotifier:
    """The daemon's side of Type=notify, on the scheduler's timers (see the module's doc).

    status() gives the STATUS= text. Until ready() nothing is sent."""

    def __init__(self, notifier: Notifier, scheduler: Scheduler, status: Callable[[], str],
                 watchdog_s: float | None) -> None:
        self.notifier = notifier
        self.scheduler = scheduler
        self.status = status
        self.watchdog_s = watchdog_s
        self._timers: dict[str, Timer] = {}
        self._extend_until: float | None = None
        self._closed = False

    @classmethod
    def from_environ(cls, scheduler: Scheduler, status: Callable[[], str],
                     environ: MutableMapping[str, str] | None = None) -> ServiceNotifier:
        """Reads and removes $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID."""
        env = os.environ if environ is None else environ
        raw = {name: env.pop(name, None) for name in ENV_VARS}
        address = socket_address(raw["NOTIFY_SOCKET"] or "")
        if raw["NOTIFY_SOCKET"] and address is None:
            log.warning("NOTIFY_SOCKET=%r is not a Unix socket address; not notifying",
                        raw["NOTIFY_SOCKET"])
        watchdog_s = watchdog_interval_s(raw["WATCHDOG_USEC"], raw["WATCHDOG_PID"], os.getpid())
        return cls(Notifier(address), scheduler, status, watchdog_s if address else None)

    def ready(self) -> None:
        if not self.notifier.enabled or self._closed:
            return
        self.notifier.send("READY=1", f"STATUS={self.status()}")
        if self.watchdog_s is not None:
            log.info("systemd watchdog: pinging every %.3gs", self.watchdog_s)
            self._watchdog()
        self._arm("status", STATUS_EVERY_S, self._status)

    def reloading(self) -> None:
        """A reload (SIGHUP) has begun; reloaded() when it is done. MONOTONIC_USEC is
        what Type=notify-reload asks with it (systemd 253); Type=notify takes it too."""
        if self.notifier.enabled and not self._closed:
            now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={now_us}",
                               "STATUS=reloading the config")

    def reloaded(self) -> None:
        if self.notifier.enabled and not self._closed:
            self.notifier.send("READY=1", f"STATUS={self.status()}")

    def stopping(self, drain_s: float) -> None:
        """The drain has started and ends within drain_s: extensions are sent until
        then (and a little after, for the workers' exit), not beyond."""
        if not self.notifier.enabled or self._closed:
            return
        self.notifier.send("STOPPING=1", f"STATUS={self.status()}")
        self._extend_until = self.scheduler.now() + drain_s + EXTEND_BY_S
        self._extend()

    def close(self) -> None:
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.notifier.close()

    def _arm(self, name: str, delay_s: float, callback: Callable[[], None]) -> None:
        if not self._closed:
            self._timers[name] = self.scheduler.call_later(delay_s, callback)

    def _watchdog(self) -> None:
        self.notifier.send("WATCHDOG=1")
        assert self.watchdog_s is not None
        self._arm("watchdog", self.watchdog_s, self._watchdog)

    def _status(self) -> None:
        self.notifier.send(f"STATUS={self.status()}")
        self._arm("status", STATUS_EVERY_S, self._status)

    def _extend(self) -> None:
        if self._extend_until is None or self.scheduler.now() >= self._extend_until:
            return
        self.notifier.send(f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY_S * 1e6)}")
        self._arm("extend", EXTEND_EVERY_S, self._extend)
