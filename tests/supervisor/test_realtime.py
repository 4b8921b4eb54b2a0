"""The event loop as SCHED_FIFO, in a child process (it changes the process it runs in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, threading
from modelpool.supervisor.realtime import enter_realtime
entered = enter_realtime()
seen = {}
thread = threading.Thread(target=lambda: seen.update(policy=os.sched_getscheduler(0)))
thread.start()
thread.join()
pid = os.fork()
if pid == 0:
    os._exit(os.sched_getscheduler(0))
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"entered": entered, "loop": os.sched_getscheduler(0),
                  "thread": seen["policy"], "child": child}))
"""


def test_only_the_calling_thread_becomes_real_time() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    found = json.loads(out.stdout)
    if not found["entered"]:  # not permitted here: nothing may have changed
        assert found["loop"] == os.SCHED_OTHER
        assert "may not use SCHED_FIFO" in out.stderr
        return
    assert found["loop"] == os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
    assert found["thread"] == os.SCHED_OTHER  # executor threads stay normal
    assert found["child"] == os.SCHED_OTHER  # so do the forkserver and its workers
