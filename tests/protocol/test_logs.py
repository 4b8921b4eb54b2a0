"""Log lines: plain text, journald's priority prefixes, JSON objects."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelpool.protocol import logs


def record(level: int, msg: str, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("modelpool.test", level, __file__, 1, msg, (), exc_info)


@pytest.mark.parametrize(("level", "priority"), [
    (logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6),
    (logging.DEBUG, 7)])
def test_syslog_priorities(level: int, priority: int) -> None:
    assert logs.syslog_priority(level) == priority


def test_under_journald_every_line_has_its_priority_and_no_time() -> None:
    fmt = logs.formatter("text", journald=True)
    assert fmt.format(record(logging.ERROR, "cannot accept")) == (
        "<3>ERROR modelpool.test: cannot accept")
    lines = fmt.format(record(logging.ERROR, "failed", exc=True)).split("\n")
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines)  # traceback too
    assert lines[-1] == "<3>ValueError: boom"


def test_plain_text_keeps_its_time() -> None:
    line = logs.formatter("text", journald=False).format(record(logging.INFO, "hello"))
    assert line.endswith(" INFO modelpool.test: hello") and line[:4].isdigit()


def test_json_is_one_object_per_line() -> None:
    line = logs.formatter("json", journald=False).format(
        record(logging.WARNING, "a\nb \"quoted\"", exc=True))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["logger"] == "modelpool.test"
    assert entry["message"] == 'a\nb "quoted"' and entry["pid"] == os.getpid()
    assert "ValueError: boom" in entry["exception"] and entry["time"] > 1.6e9
    under = logs.formatter("json", journald=True).format(record(logging.ERROR, "x"))
    assert under.startswith("<3>{") and "time" not in json.loads(under[3:])


def test_journald_is_recognised_by_the_stream_itself(tmp_path: Path) -> None:
    """JOURNAL_STREAM must name stderr's own device and inode: a child whose stderr went
    elsewhere inherits the variable but is not writing to the journal."""
    code = ("import sys; from modelpool.protocol import logs; "
            "print(logs.under_journald(sys.stderr))")
    journal = tmp_path / "journal"
    with journal.open("w") as stream:
        st = os.fstat(stream.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        same = subprocess.run([sys.executable, "-c", code], stderr=stream,
                              capture_output=False, stdout=subprocess.PIPE, env=env,
                              text=True, timeout=60, check=True)
        other = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, env=env, text=True, timeout=60,
                               check=True)
    assert same.stdout.strip() == "True"
    assert other.stdout.strip() == "False"
