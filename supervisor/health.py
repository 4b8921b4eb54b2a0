"""Is a worker alive in more than name? Pure verdicts from heartbeat and progress times.

A worker is hung when its heartbeat thread has gone quiet for heartbeat_timeout_s (the
process is stopped, deadlocked in C code that holds the GIL, or swapping to death), or
when it holds work whose progress counter has not moved for stall_timeout_s (the work
loop is stuck while the heartbeat thread still runs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerPulse:
    started_at: float
    last_heartbeat: float | None
    progress_changed_at: float
    busy: bool


def hung_reason(pulse: WorkerPulse, now: float, heartbeat_timeout_s: float,
                stall_timeout_s: float) -> str | None:
    last_sign = pulse.last_heartbeat if pulse.last_heartbeat is not None else pulse.started_at
    if now - last_sign > heartbeat_timeout_s:
        return f"no heartbeat for {now - last_sign:.1f}s"
    if pulse.busy and now - pulse.progress_changed_at > stall_timeout_s:
        return f"no progress on its work for {now - pulse.progress_changed_at:.1f}s"
    return None
