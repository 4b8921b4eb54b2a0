"""The CLI as an operator and a shell script meet it, against a real daemon: exit codes
per error class, `--socket` after the command, `-` for stdin, JSON output, health's
liveness, readiness and degraded models, load's cap and missing files, and a reader
that closes the pipe early."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, model_entry, start_daemon
from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError

CONFIG = """
[pool]
cold_start_workers = 1
max_workers_per_model = 2
max_load_failures = 1
load_backoff_s = 0.1
""" + model_entry("emb", run_s=0) + model_entry(
    "gen", loader="counting_generator", capability="text_to_text", step_s=0.001) + model_entry(
    "caller", loader="calling_generator", capability="text_to_text", step_s=0.001,
    max_workers=1) + model_entry("broken", loader="failing") + """
[[models]]
key = "see"
capability = "vision"
loader = "ops_test_loaders:size_describer"

[[models]]
key = "gone"
capability = "text_embedding"
path = "{gone}"

[[models]]
key = "hubbed"
capability = "text_embedding"
repo = "org/hubbed"
loader = "mp_test_loaders:slow_embedder"
"""


def corrupt_hub_repo(cache: Path) -> Path:
    """org/hubbed in a Hugging Face cache layout, its weights blob not matching its name."""
    base = cache / "models--org--hubbed"
    snapshot = base / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (base / "blobs").mkdir()
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text("c" * 40)
    name = hashlib.sha256(b"the real weights").hexdigest()
    (base / "blobs" / name).write_bytes(b"bit rot")
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{name}")
    return snapshot / "model.safetensors"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    workdir = tmp_path_factory.mktemp("cli-ops")
    (workdir / "gone-model").mkdir()  # there at start; a test removes it
    (workdir / "hub").mkdir()  # a Hugging Face cache holding one corrupt repo
    corrupt_hub_repo(workdir / "hub")
    daemon = start_daemon(workdir, CONFIG.replace("{gone}", str(workdir / "gone-model")),
                          env={"HF_HUB_CACHE": str(workdir / "hub")})
    daemon.workdir = workdir  # type: ignore[attr-defined]
    yield daemon
    daemon.stop()


def cli(daemon: Daemon, *args: str, stdin: bytes | None = None,
        socket_first: bool = False) -> subprocess.CompletedProcess[str]:
    where = ["--socket", daemon.socket_path]
    argv = [*where, *args] if socket_first else [*args, *where]
    raw = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", *argv],
                         input=stdin, capture_output=True, timeout=120, cwd=ROOT)
    run = subprocess.CompletedProcess(raw.args, raw.returncode, raw.stdout.decode(),
                                      raw.stderr.decode())
    assert "Traceback" not in run.stderr, run.stderr
    return run


def test_socket_after_the_command_and_stdin_for_texts(daemon: Daemon) -> None:
    run = cli(daemon, "embed", "--model", "emb", "abc", "-", stdin=b"hello\nhi\n")
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)[0] for line in run.stdout.splitlines()] == [3.0, 5.0, 2.0]


def test_stdin_prompt_and_json_lines_for_a_stream(daemon: Daemon) -> None:
    run = cli(daemon, "generate", "--model", "gen", "--max-tokens", "3", "--json", "-",
              stdin=b"one two three four\n")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["text"] for line in lines[:-1]] == ["tok0 ", "tok1 ", "tok2 "]
    assert lines[-1] == {"finish_reason": "length", "prompt_tokens": 4,
                         "completion_tokens": 3}
    asked = cli(daemon, "generate", "--model", "gen", "--max-tokens", "2", "--logprobs", "0",
                "--json", "x")
    assert asked.returncode == 0, asked.stderr
    assert [json.loads(line).get("logprobs") for line in asked.stdout.splitlines()] == [
        [{"token": "tok0 ", "token_id": 0, "logprob": 0.0, "top": {}}],
        [{"token": "tok1 ", "token_id": 1, "logprob": -1.0, "top": {}}], None]
    tools = '[{"type": "function", "function": {"name": "count"}}]'
    called = cli(daemon, "generate", "--model", "caller", "--tools", tools, "--tool-choice",
                 "auto", "--json", "x")
    assert called.returncode == 0, called.stderr
    lines = [json.loads(line) for line in called.stdout.splitlines()]
    pieces = [piece for line in lines for piece in line.get("calls", [])]
    (call,) = lines[-1]["tool_calls"]
    assert pieces[0]["name"] == call["name"] == "count" and pieces[0]["id"]
    assert len(pieces) > 3 and "".join(p["arguments"] for p in pieces) == call["arguments"]


def test_describe_prints_the_finish_reason_and_token_counts(daemon: Daemon,
                                                            tmp_path: Path) -> None:
    picture = tmp_path / "p.png"
    Image.new("RGB", (24, 16)).save(picture)
    run = cli(daemon, "describe", "--model", "see", str(picture), "what size?")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "24x16"
    assert "[stop: 2 prompt + 3 generated tokens]" in run.stderr
    buffer = io.BytesIO()
    Image.new("RGB", (8, 40)).save(buffer, format="PNG")
    piped = cli(daemon, "describe", "--model", "see", "-", stdin=buffer.getvalue())
    assert piped.returncode == 0 and piped.stdout.strip() == "8x40", piped.stderr


def test_a_loader_that_reads_one_image_refuses_several(daemon: Daemon) -> None:
    """A custom vision loader written for one image (no `reads_many_images`) is not
    handed two: the request is a typed error, and the worker serves on."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 4)).save(buffer, format="PNG")
    with daemon.client() as c:
        with pytest.raises(PoolError) as err:
            list(c.describe(buffer.getvalue(), "sizes?", more_images=[buffer.getvalue()],
                            model="see"))
        assert err.value.code is ErrorCode.BAD_REQUEST and "one image" in err.value.message
        assert "".join(ch.text for ch in c.describe(buffer.getvalue(), model="see")) == "8x4"


def test_a_missing_image_file_is_a_bad_request(daemon: Daemon) -> None:
    run = cli(daemon, "describe", "--model", "see", "no-such-cat.png")
    assert run.returncode == 5 and "no such file" in run.stderr


def test_exit_codes_by_error_class(daemon: Daemon) -> None:
    assert cli(daemon, "embed", "--model", "nobody", "x").returncode == 4
    assert cli(daemon, "generate", "--model", "gen", "--max-tokens", "0", "x").returncode == 5
    failed = cli(daemon, "embed", "--model", "broken", "x")
    assert failed.returncode == 6 and "MODEL_LOAD_FAILED" in failed.stderr


def test_structured_output_flags_reach_the_daemons_checks(daemon: Daemon) -> None:
    """The builder's json_schema, regex, choice and grammar are flags; the daemon refuses
    two languages at once, and a schema that is not JSON, naming them."""
    both = cli(daemon, "generate", "--model", "gen", "--regex", "a+", "--choice", "a",
               "--choice", "b", "x")
    assert both.returncode == 5 and "not regex and choice" in both.stderr
    schema = cli(daemon, "generate", "--model", "gen", "--json-schema", "{oops", "x")
    assert schema.returncode == 5 and "json_schema: a JSON Schema" in schema.stderr


def test_tool_choice_takes_its_two_values_and_reaches_the_model(daemon: Daemon) -> None:
    """--tool-choice auto without tools is refused by the daemon's checks; with tools,
    by a model whose loader reads no tool calls; a value it does not take, by the CLI."""
    alone = cli(daemon, "generate", "--model", "gen", "--tool-choice", "auto", "x")
    assert alone.returncode == 5 and "it has none" in alone.stderr
    tools = '[{"type": "function", "function": {"name": "f"}}]'
    unread = cli(daemon, "generate", "--model", "gen", "--tools", tools, "--tool-choice",
                 "auto", "x")
    assert unread.returncode == 5 and "does not read tool calls" in unread.stderr
    shown = cli(daemon, "generate", "--model", "gen", "--tools", tools, "--max-tokens", "1",
                "x")
    assert shown.returncode == 0 and shown.stdout == "tok0 \n", shown.stderr
    wrong = cli(daemon, "generate", "--model", "gen", "--tool-choice", "maybe", "x")
    assert wrong.returncode == 2 and "invalid choice: 'maybe'" in wrong.stderr


def test_health_separates_live_ready_and_degraded(daemon: Daemon) -> None:
    cli(daemon, "embed", "--model", "broken", "x")  # fails its one allowed load
    report = cli(daemon, "health", "--json")
    assert report.returncode == 1
    verdict = json.loads(report.stdout)
    assert verdict["live"] and verdict["ready"] and verdict["state"] == "degraded"
    assert "broken" in verdict["unhealthy"]
    assert cli(daemon, "health", "--live").returncode == 0
    assert cli(daemon, "health", "--ready", socket_first=True).returncode == 0
    one = cli(daemon, "health", "broken", "--json")
    assert one.returncode == 1 and json.loads(one.stdout)["state"] == "failed"
    assert cli(daemon, "health", "emb").returncode == 0
    assert cli(daemon, "health", "nobody").returncode == 4


def test_load_says_why_it_capped_and_unload_answers_json(daemon: Daemon) -> None:
    run = cli(daemon, "load", "emb", "--workers", "5", "--json")
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["model"] == "emb" and answer["healthy"]
    assert "asked for 5, capped at 2: [pool] max_workers_per_model = 2" in answer["message"]
    unload = cli(daemon, "unload", "emb", "--json")
    assert unload.returncode == 0 and "stopping" in json.loads(unload.stdout)["message"]


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(daemon: Daemon) -> None:
    texts = " ".join(f"t{i}" for i in range(3000))
    command = (f"{sys.executable} -m modelpool.supervisor.cli --socket {daemon.socket_path} "
               f"embed --model emb {texts} | head -c 10")
    run = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert len(run.stdout) == 10
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr
    assert run.returncode in (0, 141)


def test_more_than_4096_texts_are_split_by_the_client(daemon: Daemon) -> None:
    with daemon.client() as c:
        rows = c.embed([str(i) for i in range(9000)], model="emb")
        reply = c.reply("embed", [str(i) for i in range(9000)], model="emb")
    assert rows.shape == (9000, 8)
    assert rows[5, 0] == 1 and rows[8999, 0] == 4
    assert reply.shape == [9000, 8] and reply.data == rows.tobytes()  # merged as one


def test_load_of_a_model_whose_path_is_gone_says_so_at_once(daemon: Daemon) -> None:
    (daemon.workdir / "gone-model").rmdir()  # type: ignore[attr-defined]
    started = time.monotonic()
    run = cli(daemon, "load", "gone")
    assert run.returncode == 6 and "gone-model does not exist" in run.stderr
    request = cli(daemon, "embed", "--model", "gone", "x")
    assert request.returncode == 6 and "gone-model does not exist" in request.stderr
    assert time.monotonic() - started < 20  # two CLI starts, no load, no timeout


def test_the_default_text_model_not_downloaded_names_the_pull_at_once(daemon: Daemon) -> None:
    started = time.monotonic()
    run = cli(daemon, "generate", "Once upon a time")
    assert run.returncode == 6
    assert "run `modelpool pull Qwen/Qwen2.5-0.5B-Instruct`" in run.stderr
    assert time.monotonic() - started < 15  # not the 30 s timeout


def test_a_corrupt_hub_file_fails_the_load_naming_it_and_the_repair(daemon: Daemon) -> None:
    weights = daemon.workdir / "hub" / "models--org--hubbed" / "snapshots" / ("c" * 40)
    run = cli(daemon, "embed", "--model", "hubbed", "x")
    assert run.returncode == 6
    assert f"{weights / 'model.safetensors'} is corrupt" in run.stderr
    assert "run `modelpool pull hubbed --repair`" in run.stderr
