"""Loads run niced; afterwards every thread of the worker is back at its priority."""

from __future__ import annotations

import os
import threading

import pytest

from workers import priority


def run_in_fresh_thread(body: object) -> None:
    """Nice values are per thread: test in a throwaway thread, not pytest's main one."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            body()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@pytest.mark.skipif(not priority.can_restore(os.getpriority(os.PRIO_PROCESS, 0)),
                    reason="needs CAP_SYS_NICE or RLIMIT_NICE to restore priority")
def test_lower_then_restore_covers_threads_started_meanwhile() -> None:
    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        token = priority.lower()
        assert token == before
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, before + priority.LOAD_NICENESS)
        seen: list[int] = []
        stop = threading.Event()

        def child() -> None:  # like a torch pool thread started during the load
            seen.append(threading.get_native_id())
            stop.wait(5)

        helper = threading.Thread(target=child)
        helper.start()
        while not seen:
            pass
        assert os.getpriority(os.PRIO_PROCESS, seen[0]) == min(19, before + 10)
        priority.restore(token)
        assert os.getpriority(os.PRIO_PROCESS, tid) == before
        assert os.getpriority(os.PRIO_PROCESS, seen[0]) == before
        stop.set()
        helper.join()

    run_in_fresh_thread(body)


def test_nothing_is_lowered_when_it_could_not_be_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "can_restore", lambda nice: False)

    def body() -> None:
        before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert priority.lower() is None
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
        priority.restore(None)

    run_in_fresh_thread(body)
