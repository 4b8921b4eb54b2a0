"""Worker exit codes: a contract between workers and the supervisor (and operators).

A negative exit code from multiprocessing means "killed by that signal" (-9: SIGKILL,
e.g. the OOM killer or a hang kill).
"""

from __future__ import annotations

OK = 0  # asked to stop, stopped
LOAD_FAILED = 3  # the model could not be loaded; LoadFailed(cause) was sent first
SUPERVISOR_GONE = 4  # the work pipe closed: the supervisor died or dropped us
PROTOCOL_ERROR = 5  # the supervisor sent something a worker cannot understand
INTERNAL_ERROR = 6  # an unexpected exception in the worker loop itself

NAMES = {
    OK: "ok",
    LOAD_FAILED: "load_failed",
    SUPERVISOR_GONE: "supervisor_gone",
    PROTOCOL_ERROR: "protocol_error",
    INTERNAL_ERROR: "internal_error",
}


def describe(exitcode: int | None) -> str:
    """Human words for an exit code, for logs and error messages."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode} ({NAMES.get(exitcode, 'unknown')})"
