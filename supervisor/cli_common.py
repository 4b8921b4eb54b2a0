"""What every `modelpool` command shares: exit codes per error class, `-` for stdin,
options accepted after the subcommand, and a quiet end when stdout is closed early
(`modelpool embed ... | head -c 10`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError

EXIT_OK = 0
EXIT_FAILED = 1  # anything else; `health`: unhealthy or degraded
EXIT_USAGE = 2  # bad arguments or a bad config (argparse's own code)
EXIT_UNREACHABLE = 3
EXIT_UNKNOWN_MODEL = 4
EXIT_BAD_REQUEST = 5
EXIT_MODEL_FAILURE = 6
EXIT_BUSY = 7  # try again later: queue full, overloaded, timed out, shutting down
EXIT_BROKEN_PIPE = 141  # as a process killed by SIGPIPE: 128 + 13

_CLASSES: dict[int, tuple[ErrorCode, ...]] = {
    EXIT_UNREACHABLE: (ErrorCode.UNAVAILABLE, ErrorCode.PROTOCOL_VERSION),
    EXIT_UNKNOWN_MODEL: (ErrorCode.UNKNOWN_MODEL, ErrorCode.WRONG_CAPABILITY,
                         ErrorCode.RESULT_NOT_FOUND),
    EXIT_BAD_REQUEST: (ErrorCode.BAD_REQUEST, ErrorCode.IMAGE_TOO_LARGE,
                       ErrorCode.URL_NOT_ALLOWED, ErrorCode.PERMISSION_DENIED),
    EXIT_MODEL_FAILURE: (ErrorCode.MODEL_LOAD_FAILED, ErrorCode.MODEL_ERROR,
                         ErrorCode.WORKER_DIED, ErrorCode.INSUFFICIENT_MEMORY),
    EXIT_BUSY: (ErrorCode.QUEUE_FULL, ErrorCode.OVERLOADED, ErrorCode.TIMEOUT,
                ErrorCode.DEADLINE_EXPIRED, ErrorCode.SHUTTING_DOWN, ErrorCode.CANCELLED),
}
_BY_CODE: dict[ErrorCode, int] = {code: exit for exit, codes in _CLASSES.items()
                                  for code in codes}

EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK}    success (health: healthy)
  {EXIT_FAILED}    failure not listed below (health: unhealthy or degraded)
  {EXIT_USAGE}    bad arguments, or a config that does not hold (serve)
  {EXIT_UNREACHABLE}    the daemon is unreachable: UNAVAILABLE, PROTOCOL_VERSION
  {EXIT_UNKNOWN_MODEL}    unknown model or job: UNKNOWN_MODEL, WRONG_CAPABILITY, RESULT_NOT_FOUND
  {EXIT_BAD_REQUEST}    bad request: BAD_REQUEST, IMAGE_TOO_LARGE, URL_NOT_ALLOWED, \
PERMISSION_DENIED, a missing input file
  {EXIT_MODEL_FAILURE}    model failure: MODEL_LOAD_FAILED, MODEL_ERROR, WORKER_DIED, \
INSUFFICIENT_MEMORY
  {EXIT_BUSY}    busy, try later: QUEUE_FULL, OVERLOADED, TIMEOUT, DEADLINE_EXPIRED, \
SHUTTING_DOWN, CANCELLED
  {EXIT_BROKEN_PIPE}  stdout was closed early (e.g. `| head`)
A prompt, text or image given as `-` is read from stdin (texts: one per line)."""


def exit_code(code: ErrorCode) -> int:
    return _BY_CODE.get(code, EXIT_FAILED)


def report(exc: PoolError, as_json: bool) -> int:
    """Say what failed (stderr; with --json also a JSON object on stdout) and return
    the exit code of its class."""
    print(f"modelpool: {exc}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": {"code": exc.code.value, "message": exc.message}}))
    return exit_code(exc.code)


def quiet_broken_pipe() -> int:
    """stdout's reader is gone: point stdout at /dev/null so that the interpreter's
    final flush raises nothing, and end as a SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def on_terminal() -> bool:
    """Progress bars only for a person watching: stderr is a terminal."""
    return sys.stderr.isatty()


def add_after_subcommands(parser: argparse.ArgumentParser, *flags: str, **kwargs: Any) -> None:
    """Accept an option of the top-level parser after any subcommand too (`modelpool
    health --socket S`). SUPPRESS keeps a value given before the subcommand when the
    subcommand's parser does not see the option."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                sub.add_argument(*flags, default=argparse.SUPPRESS, **kwargs)
                add_after_subcommands(sub, *flags, **kwargs)


class Stdin:
    """`-` in place of a prompt, a text or an image: read stdin, once."""

    def __init__(self) -> None:
        self._data: bytes | None = None

    def _read(self) -> bytes:
        if self._data is None:
            self._data = sys.stdin.buffer.read()
        return self._data

    def text(self) -> str:
        return self._read().decode().removesuffix("\n")

    def lines(self) -> list[str]:
        return [line for line in self._read().decode().splitlines() if line.strip()]

    def image(self) -> bytes:
        return self._read()


def from_stdin(name: str, value: Any, stdin: Stdin) -> Any:
    """The argument `name` with any `-` replaced by what stdin holds."""
    image = name in ("image", "images")
    if value == "-":
        return stdin.image() if image else stdin.text()
    if isinstance(value, list) and "-" in value:
        out: list[Any] = []
        for item in value:
            if item != "-":
                out.append(item)
            elif image:
                out.append(stdin.image())
            else:
                out.extend(stdin.lines())
        return out
    return value
