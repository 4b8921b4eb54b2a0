"""What every CLI command shares: exit codes per error class, options after the
subcommand, `-` for stdin, and a quiet end on a closed stdout."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from modelpool.protocol.client_core import make_call, merged, split_call
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.inputs import image_input
from modelpool.protocol.messages import Embeddings, Error, Scores
from modelpool.supervisor import cli_common
from modelpool.supervisor.cli import _parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_every_error_code_has_one_exit_code_and_the_classes_are_distinct() -> None:
    assert cli_common.exit_code(ErrorCode.UNAVAILABLE) == cli_common.EXIT_UNREACHABLE == 3
    assert cli_common.exit_code(ErrorCode.UNKNOWN_MODEL) == 4
    assert cli_common.exit_code(ErrorCode.BAD_REQUEST) == 5
    assert cli_common.exit_code(ErrorCode.MODEL_LOAD_FAILED) == 6
    assert cli_common.exit_code(ErrorCode.QUEUE_FULL) == 7
    assert cli_common.exit_code(ErrorCode.INTERNAL) == 1
    classes = [codes for codes in cli_common._CLASSES.values()]
    flat = [code for codes in classes for code in codes]
    assert len(flat) == len(set(flat))  # no code in two classes
    help_text = _parser().format_help()
    for exit_code in (3, 4, 5, 6, 7):
        assert f"\n  {exit_code}  " in help_text


@pytest.mark.parametrize("argv", [
    ["--socket", "/s", "health"],
    ["health", "--socket", "/s"],
    ["embed", "x", "--socket", "/s"],
    ["submit", "embed", "x", "--socket", "/s"],
    ["--socket", "/s", "submit", "embed", "x"],
])
def test_socket_is_accepted_before_or_after_the_subcommand(argv: list[str]) -> None:
    assert _parser().parse_args(argv).socket == "/s"


def test_no_socket_anywhere_is_none() -> None:
    assert _parser().parse_args(["health"]).socket is None


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("modelpool 0.")


def test_dash_reads_stdin_once(monkeypatch: pytest.MonkeyPatch) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(b"first line\nsecond\n\n"))
    monkeypatch.setattr(sys, "stdin", stdin)
    reader = cli_common.Stdin()
    assert cli_common.from_stdin("prompt", "-", reader) == "first line\nsecond\n"
    assert cli_common.from_stdin("texts", ["a", "-", "b"], reader) == [
        "a", "first line", "second", "b"]
    assert cli_common.from_stdin("images", ["-"], reader) == [b"first line\nsecond\n\n"]
    assert cli_common.from_stdin("prompt", "x", reader) == "x"


def test_an_unreachable_daemon_exits_3_and_json_says_so(tmp_path: Path) -> None:
    gone = str(tmp_path / "none.sock")
    for argv in (["embed", "x", "--socket", gone], ["health", "--json", "--socket", gone]):
        run = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", *argv],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert run.returncode == 3, run.stderr
        assert "Traceback" not in run.stderr
    assert '"state": "unreachable"' in run.stdout


@pytest.mark.parametrize("image", ["cat.png", "photos/cat", Path("/no/such/cat.png")])
def test_a_missing_image_file_says_no_such_file(image: object) -> None:
    with pytest.raises(PoolError) as err:
        image_input(image)
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert "no such file" in err.value.message.lower()


def test_more_texts_than_one_request_takes_are_split_and_merged_in_order() -> None:
    texts = [str(i) for i in range(4096 * 2 + 5)]
    call = make_call("embed", 1, (texts,), {})
    ids = iter(range(100, 200))
    parts = split_call(call, ids)
    assert [len(p.texts) for p in parts] == [4096, 4096, 5]
    assert [p.id for p in parts] == [100, 101, 102]
    assert [t for p in parts for t in p.texts] == texts
    replies = [Embeddings(id=p.id, data=np.full((len(p.texts), 2), i, "<f4").tobytes(),
                          shape=[len(p.texts), 2]) for i, p in enumerate(parts)]
    rows = merged(call, replies)
    assert rows.shape == (len(texts), 2)
    assert rows[0, 0] == 0 and rows[4096, 0] == 1 and rows[-1, 0] == 2
    assert split_call(make_call("embed", 1, (["a"],), {}), ids)[0].id == 1


def test_a_failed_part_fails_the_whole_request() -> None:
    call = make_call("rerank", 1, ("q", ["d"] * 5000), {})
    parts = split_call(call, iter(range(10, 20)))
    assert [len(p.documents) for p in parts] == [4096, 904]
    replies = [Scores(id=10, data=np.zeros(4096, "<f4").tobytes(), shape=[4096]),
               Error(id=11, code=ErrorCode.MODEL_ERROR, message="bad")]
    with pytest.raises(PoolError) as err:
        merged(call, replies)
    assert err.value.code is ErrorCode.MODEL_ERROR
