"""How the daemon and its workers write log lines to stderr.

- `text` (the default): `2024-05-01 12:00:00,000 INFO modelpool.server: message`.
- `json`: one JSON object per line: `time` (seconds since the epoch), `level`,
  `logger`, `pid`, `message` and, for an exception, `exception` (its traceback).
- Under journald (stderr is the stream $JOURNAL_STREAM names, as systemd connects a
  service's stderr): no time (the journal stamps every line) and each line starts with
  its syslog priority, `<3>` for an error, `<4>` a warning, `<6>` info, `<7>` debug,
  which journald strips and records, so `journalctl -p err` finds errors. Every line of
  a multi-line message (a traceback) carries it.

The daemon chooses (`[daemon] log_format`, `log_level`) and hands the choice to its
workers through MODELPOOL_LOG_FORMAT and MODELPOOL_LOG_LEVEL.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Literal

LogFormat = Literal["text", "json"]
FORMAT_ENV = "MODELPOOL_LOG_FORMAT"
LEVEL_ENV = "MODELPOOL_LOG_LEVEL"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL_FORMAT = "%(levelname)s %(name)s: %(message)s"


def syslog_priority(levelno: int) -> int:
    """syslog(3)'s priority for a logging level: 2 critical ... 7 debug."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    return 6 if levelno >= logging.INFO else 7


def under_journald(stream: object = None) -> bool:
    """Whether stream (default: stderr) is the journal stream $JOURNAL_STREAM names
    ("device:inode"); not just whether the variable is set, since a child whose stderr
    was redirected elsewhere inherits it too."""
    value = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    stream = sys.stderr if stream is None else stream
    try:
        st = os.fstat(stream.fileno())  # type: ignore[attr-defined]
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (AttributeError, ValueError, OSError):
        return False


class JsonFormatter(logging.Formatter):
    def __init__(self, with_time: bool = True) -> None:
        super().__init__()
        self.with_time = with_time

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {}
        if self.with_time:
            entry["time"] = round(record.created, 6)
        entry.update(level=record.levelname, logger=record.name, pid=record.process,
                     message=record.getMessage())
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, default=str, ensure_ascii=False)


class JournalFormatter(logging.Formatter):
    """Prefixes every line of the formatted record with its syslog priority."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in self.inner.format(record).split("\n"))


def formatter(log_format: LogFormat, journald: bool) -> logging.Formatter:
    if log_format == "json":
        inner: logging.Formatter = JsonFormatter(with_time=not journald)
    else:
        inner = logging.Formatter(JOURNAL_FORMAT if journald else TEXT_FORMAT)
    return JournalFormatter(inner) if journald else inner


def configure(level: str | int, log_format: LogFormat = "text") -> None:
    """The process's root logger: one handler on stderr in the chosen format. Python
    warnings (warnings.warn) become log records too."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, under_journald(sys.stderr)))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)


def hand_down(level: str, log_format: LogFormat) -> None:
    """What configure_from_env reads in the daemon's children."""
    os.environ[FORMAT_ENV] = log_format
    os.environ[LEVEL_ENV] = level


def configure_from_env(min_level: int = logging.WARNING) -> None:
    """In a worker: the daemon's format, at its level but never below min_level (the
    libraries' info lines would flood the daemon's log)."""
    log_format = os.environ.get(FORMAT_ENV, "text")
    name = os.environ.get(LEVEL_ENV, "WARNING").upper()
    level = logging.getLevelName(name)
    configure(max(level if isinstance(level, int) else logging.WARNING, min_level),
              "json" if log_format == "json" else "text")
