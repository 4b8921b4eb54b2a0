"""Workers start and load at idle priority; at Ready every thread goes back."""

from __future__ import annotations

import os
import threading

import pytest

from modelpool.workers import priority


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
def test_lowered_threads_and_their_children_are_idle_until_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "_restore_nice", None)

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        assert priority.lower()
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        seen: list[int] = []
        stop = threading.Event()

        def child() -> None:  # like a torch pool thread started during the load
            seen.append(threading.get_native_id())
            stop.wait(5)

        helper = threading.Thread(target=child)
        helper.start()
        while not seen:
            pass
        assert os.sched_getscheduler(seen[0]) == os.SCHED_IDLE  # inherited
        priority.restore_all_threads()
        for thread in (tid, seen[0]):
            assert os.sched_getscheduler(thread) == os.SCHED_BATCH
            assert os.getpriority(os.PRIO_PROCESS, thread) == before
        priority.restore_this_thread()  # the heartbeat's way back: a normal thread
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        stop.set()
        helper.join()

    run_in_fresh_thread(body)


def test_nothing_is_lowered_when_it_could_not_be_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "can_restore", lambda nice: False)
    monkeypatch.setattr(priority, "_restore_nice", None)

    def body() -> None:
        tid = threading.get_native_id()
        policy = os.sched_getscheduler(tid)
        assert not priority.lower()
        priority.restore_all_threads()
        assert os.sched_getscheduler(tid) == policy

    run_in_fresh_thread(body)


def test_idle_for_exit_covers_every_thread_and_needs_no_privilege() -> None:
    pid = os.fork()  # in a child: this would leave pytest itself at idle priority
    if pid == 0:
        stop = threading.Event()
        helper = threading.Thread(target=stop.wait, args=(5,))
        helper.start()
        priority.idle_all_threads()
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        ok = len(tids) == 2 and all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in tids)
        stop.set()
        helper.join()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
