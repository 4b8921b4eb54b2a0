"""Well-formed requests of hostile values against a real daemon (tiny LLM, tiny vision
model; generate, describe, tokenize, detokenize): every one, direct or as a job, gets
exactly one final reply, typed; none is an internal error or costs a worker; the daemon
logs no error."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest
from adversarial_helpers import greeted, reply, running_daemon, send_raw
from field_fuzz import HostileValues, coherent

from modelpool.protocol.client import Client
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.jobs import JobKey, JobResult
from modelpool.protocol.messages import (
    Chunk,
    Describe,
    Detokenize,
    Detokenized,
    End,
    Error,
    Generate,
    Tokenize,
    Tokenized,
)

REQUESTS = 300
CONFIG = """
    [[models]]
    key = "tiny-llm"
    capability = "text_to_text"
    path = "{models}/tiny-llm"
    options = {{ context = 640 }}
    max_workers = 1
    [[models]]
    key = "tiny-vision"
    capability = "vision"
    path = "{models}/tiny-vision"
    max_workers = 1
"""
# what a request's own values may earn it; the others are the daemon's failures
REFUSALS = {ErrorCode.BAD_REQUEST, ErrorCode.IMAGE_TOO_LARGE}


def _final(sock: socket.socket, rid: int) -> Any:
    """The request's final reply, its chunks (its own id each) read past."""
    while True:
        msg = reply(sock)
        assert msg.id == rid, msg
        if not isinstance(msg, Chunk):
            return msg


def _as_job(sock: socket.socket, rid: int, body: dict[str, Any], rng: random.Random) -> Any:
    """Submitted, then followed (streamed or whole) or retrieved: the job's final reply."""
    send_raw(sock, msgspec.msgpack.encode(
        {"op": "submit", "id": rid, "request": body, "stream": rng.random() < 0.5}))
    submitted = reply(sock)
    assert submitted.id == rid and isinstance(submitted, JobKey | Error), submitted
    if isinstance(submitted, Error):
        return submitted
    if rng.random() < 0.5:
        send_raw(sock, msgspec.msgpack.encode({"op": "follow", "id": rid, "key": submitted.key}))
        return _final(sock, rid)
    send_raw(sock, msgspec.msgpack.encode(
        {"op": "retrieve", "id": rid, "key": submitted.key, "timeout_s": 60}))
    retrieved = reply(sock)
    assert retrieved.id == rid, retrieved
    return retrieved


@pytest.mark.real_process
def test_hostile_values_each_get_one_typed_reply_and_cost_no_worker(
        tmp_path: Path, tiny_models_dir: Path) -> None:
    config = CONFIG.format(models=tiny_models_dir)
    rng = random.Random(20261204)
    kinds = {"generate": (HostileValues(Generate, rng), "tiny-llm"),
             "describe": (HostileValues(Describe, rng), "tiny-vision"),
             "tokenize": (HostileValues(Tokenize, rng), "tiny-llm"),
             "detokenize": (HostileValues(Detokenize, rng), "tiny-llm")}
    answered = {op: 0 for op in kinds}
    with running_daemon(tmp_path, config) as daemon:
        with Client(daemon.socket_path, timeout_s=120) as client:
            client.generate("hi", model="tiny-llm", max_tokens=1)
            workers = {p.pid for p in daemon.descendants()}
        with greeted(daemon.socket_path, timeout_s=120) as sock:
            for rid in range(1, REQUESTS + 1):
                op = rng.choice(sorted(kinds))
                values, model = kinds[op]
                body = values.request()
                if rng.random() < 0.85:
                    coherent(op, body, rng, values.images)
                body.update(op=op, id=rid, model=model)
                for key in ("timeout_s", "deadline_s", "sent_at"):
                    body.pop(key, None)
                if op in ("generate", "describe"):
                    body.setdefault("sampling", {})["max_tokens"] = rng.choice([1, 4, 8])
                    body["sampling"].pop("min_tokens", None)  # each request short
                if rng.random() < 0.25:
                    final = _as_job(sock, rid, body, rng)
                else:
                    send_raw(sock, msgspec.msgpack.encode(body))
                    final = _final(sock, rid)
                assert isinstance(final, End | Tokenized | Detokenized | Error | JobResult), final
                if isinstance(final, Error):
                    assert final.code in REFUSALS, (final, body)
                else:
                    answered[op] += 1
        assert {p.pid for p in daemon.descendants()} >= workers  # no worker lost
    assert min(answered.values()) > REQUESTS // (3 * len(kinds)), answered  # each reached
    log = daemon.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
