"""The HTTP API as a service: jobs, /metrics read by Prometheus' own parser, a client
that leaves cancels its work, the start refused where it would be unsafe, the front
door's process restarted, and the same API served from the supervisor's loop."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import psutil
import pytest
from conftest import ROOT, Daemon, daemon_env, fresh_socket_path
from http_helpers import (
    KEY,
    MINILM,
    free_port,
    http_daemon,
    running,
    wait_for_http,
    wait_idle,
    wait_running,
)
from prometheus_client.parser import text_string_to_metric_families

AUTH = {"Authorization": f"Bearer {KEY}"}


# A second key whose HTTP client shares KEY's connection to the daemon (crc32 % 8).
SAME_CONNECTION_KEY = "another-tenants-key-6"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path,
           tiny_rerank_export: None) -> Iterator[tuple[Daemon, str]]:
    workdir = tmp_path_factory.mktemp("http-service")
    (workdir / "keys").write_text(SAME_CONNECTION_KEY + "\n")
    daemon, base = http_daemon(workdir, tiny_models_dir,
                               http=f'api_key_file = "{workdir}/keys"', extra=f"""
        [[models]]
        key = "one-at-a-time"
        capability = "text_embedding"
        loader = "mp_test_loaders:slow_embedder"
        options = {{ run_s = 0.5, log = "{workdir}/ran" }}
        max_workers = 1
        max_batch = 1
        max_queue = 8
    """)
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


def test_http_clients_sharing_a_connection_take_turns(served: tuple[Daemon, str]) -> None:
    """Each key takes a turn of its own in the queues, though the front door carries both
    over one connection to the daemon (whose own requests go first come, first served),
    and no key fills its user's share of a queue: a flood of ten under one key neither
    holds up nor shuts out another key's one request."""
    assert (zlib.crc32(f"Bearer {KEY}".encode()) % 8
            == zlib.crc32(f"Bearer {SAME_CONNECTION_KEY}".encode()) % 8)

    def embed(key: str, text: str) -> httpx.Response:
        return httpx.post(served[1] + "/v1/embeddings", timeout=60, json={
            "model": "one-at-a-time", "input": text},
            headers={"Authorization": f"Bearer {key}"})

    assert embed(KEY, "warm").status_code == 200  # its worker idle, not loading
    ran = Path(served[0].log_path).parent / "ran"
    with ThreadPoolExecutor(11) as pool:
        flood = [pool.submit(embed, KEY, f"flood {i}") for i in range(10)]
        deadline = time.monotonic() + 30
        with served[0].client() as c:
            # max_queue 8: the daemon's user may hold 6 waiting, one tenant of it 5.
            while running(c, "one-at-a-time") < 6 or sum(f.done() for f in flood) < 3:
                assert time.monotonic() < deadline, "the flood did not arrive"
                time.sleep(0.02)
        polite = pool.submit(embed, SAME_CONNECTION_KEY, "polite")
        answers = [f.result() for f in flood]
        assert polite.result().status_code == 200
    refused = [a for a in answers if a.status_code == 429]
    assert len(refused) >= 3 and all("tenant" in a.json()["error"]["message"]
                                     for a in refused)
    order = ran.read_text().split("\n")[1:]
    assert order.index("polite") <= 2, order  # one or two flood requests were under way



def test_a_job_outlives_its_connection(served: tuple[Daemon, str]) -> None:
    created = httpx.post(served[1] + "/v1/jobs", headers=AUTH, json={
        "operation": "embeddings", "body": {"model": MINILM, "input": ["a", "b"]}})
    assert created.status_code == 202, created.text
    key = created.json()["id"]
    shown = httpx.get(f"{served[1]}/v1/jobs/{key}?wait=30", headers=AUTH, timeout=60).json()
    assert shown["status"] == "done" and shown["operation"] == "embed"
    with served[0].client() as c:
        expected = c.embed(["a", "b"], model=MINILM)
        assert c.job(key)["state"] == "done"  # the same job, seen from the socket
    np.testing.assert_allclose([d["embedding"] for d in shown["result"]["data"]], expected,
                               atol=1e-6)
    missing = httpx.get(f"{served[1]}/v1/jobs/nope", headers=AUTH)
    assert missing.status_code == 404


def test_a_jobs_body_takes_a_logit_bias_and_logprobs_as_the_endpoint_does(
        served: tuple[Daemon, str]) -> None:
    created = httpx.post(served[1] + "/v1/jobs", headers=AUTH, json={
        "operation": "completions", "body": {"model": "tiny-llm", "prompt": "x",
                                             "max_tokens": 4, "temperature": 0,
                                             "logit_bias": {"100": 100}}})
    assert created.status_code == 202, created.text
    key = created.json()["id"]
    shown = httpx.get(f"{served[1]}/v1/jobs/{key}?wait=30", headers=AUTH, timeout=60).json()
    with served[0].client() as c:
        expected = "".join(ch.text for ch in c.generate(
            "x", model="tiny-llm", max_tokens=4, temperature=0, raw=True,
            logit_bias={100: 100.0}))
    assert shown["status"] == "done" and shown["result"]["text"] == expected
    with_logprobs = httpx.post(served[1] + "/v1/jobs", headers=AUTH, json={
        "operation": "chat.completions", "body": {
            "model": "tiny-llm", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1}})
    assert with_logprobs.status_code == 202, with_logprobs.text
    done = httpx.get(f"{served[1]}/v1/jobs/{with_logprobs.json()['id']}?wait=30",
                     headers=AUTH, timeout=60).json()["result"]
    tokens = done["logprobs"]["content"]
    assert len(tokens) == done["usage"]["completion_tokens"] == 4
    assert "".join(t["token"] for t in tokens) == done["text"]
    assert all(t["top_logprobs"][0]["logprob"] == t["logprob"] for t in tokens)  # greedy
    assert shown["result"]["logprobs"] is None  # not asked
    echoed = httpx.post(served[1] + "/v1/jobs", headers=AUTH, json={
        "operation": "completions", "body": {"model": "tiny-llm", "prompt": "x y z",
                                             "max_tokens": 1, "echo": True, "logprobs": 0}})
    result = httpx.get(f"{served[1]}/v1/jobs/{echoed.json()['id']}?wait=30", headers=AUTH,
                       timeout=60).json()["result"]
    prompt = result["prompt_logprobs"]["content"]
    assert len(prompt) == result["usage"]["prompt_tokens"] and prompt[0]["logprob"] is None
    assert all(t["logprob"] < 0 for t in prompt[1:])
    several = httpx.post(served[1] + "/v1/jobs", headers=AUTH, json={
        "operation": "completions", "body": {"model": "tiny-llm", "prompt": "x", "n": 2}})
    assert several.status_code == 400 and several.json()["error"]["param"] == "body.n"


def test_a_job_cancelled_over_http(served: tuple[Daemon, str]) -> None:
    key = httpx.post(served[1] + "/v1/jobs", headers=AUTH, json={
        "operation": "completions", "body": {"model": "counter", "prompt": "x",
                                             "max_tokens": 2000}}).json()["id"]
    cancelled = httpx.delete(f"{served[1]}/v1/jobs/{key}", headers=AUTH).json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["error"]["code"] == "cancelled"


def _samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_move(served: tuple[Daemon, str]) -> None:
    ok = ("modelpool_requests_total", (("code", "OK"), ("model", MINILM),
                                       ("operation", "embed"), ("priority", "high")))
    latency = ("modelpool_request_duration_seconds_count",
               (("model", MINILM), ("operation", "embed")))
    before = _samples(served[1])
    for _ in range(3):
        assert httpx.post(served[1] + "/v1/embeddings", json={"input": "x", "model": MINILM},
                          headers={**AUTH, "X-Modelpool-Priority": "high"}).status_code == 200
    after = _samples(served[1])
    assert after[ok] - before.get(ok, 0) == 3
    assert after[latency] - before.get(latency, 0) >= 3
    workers = ("modelpool_workers", (("model", MINILM), ("state", "idle")))
    assert after[workers] >= 1
    assert after[("modelpool_memory_budget_bytes", ())] > 0
    http = ("modelpool_http_requests_total", (("path", "/v1/embeddings"), ("status", "200")))
    assert after[http] - before.get(http, 0) == 3


def test_metrics_count_streams_prompt_cached_and_generated_tokens(
        served: tuple[Daemon, str]) -> None:
    names = {field: (f"modelpool_{name}_total", (("model", "tiny-llm"),)) for field, name in (
        ("prompt_tokens", "prompt_tokens"), ("cached_tokens", "prompt_tokens_cached"),
        ("completion_tokens", "generation_tokens"))}
    before = _samples(served[1])
    system = {"role": "system", "content": "You are a tiny model; answer in tiny words."}
    usages = [httpx.post(served[1] + "/v1/chat/completions", headers=AUTH, json={
        "model": "tiny-llm", "messages": [system, {"role": "user", "content": question}],
        "max_tokens": 3, "temperature": 0}).json()["usage"] for question in ("rivers", "hills")]
    after = _samples(served[1])
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert {field: after[name] - before.get(name, 0) for field, name in names.items()} == {
        "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
        "completion_tokens": sum(u["completion_tokens"] for u in usages)}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_generation(served: tuple[Daemon, str],
                                                     stream: bool) -> None:
    """2000 tokens of the counter take 100 s: done within seconds means cancelled."""
    body = {"model": "counter", "prompt": "x", "max_tokens": 2000, "stream": stream}
    warm = httpx.post(served[1] + "/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "max_tokens": 1, "stream": False})
    assert warm.status_code == 200
    with httpx.Client(base_url=served[1], headers=AUTH, timeout=1.0) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                next(response.iter_lines())
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body)
    assert wait_idle(served[0], "counter") < 10


def test_a_client_that_leaves_takes_its_request_out_of_the_queue(
        served: tuple[Daemon, str]) -> None:
    """slow-embed runs one batch at a time for 3 s: a request queued behind one that
    runs, whose client then leaves, is gone from the queue long before that one ends."""
    with served[0].client() as c:
        c.embed("warm", model="slow-embed")
        first = subprocess.Popen([sys.executable, "-c", (
            "import sys; from modelpool.protocol.client import Client; "
            f"Client({served[0].socket_path!r}).embed('a', model='slow-embed')")])
        try:
            while running(c, "slow-embed") == 0:
                time.sleep(0.02)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(served[1] + "/v1/embeddings", headers=AUTH, timeout=0.5,
                           json={"model": "slow-embed", "input": "b"})
            time.sleep(0.5)
            queued = next(m["queued"] for m in c.status()["models"] if m["key"] == "slow-embed")
            assert first.poll() is None and queued == 0
        finally:
            first.wait(30)


def test_deadline_header_is_504(served: tuple[Daemon, str]) -> None:
    response = httpx.post(served[1] + "/v1/completions", timeout=30,
                          headers={**AUTH, "X-Modelpool-Timeout": "0.3"},
                          json={"model": "counter", "prompt": "x", "max_tokens": 200})
    assert response.status_code == 504, response.text
    wait_idle(served[0], "counter")


def test_draining_is_not_ready_but_healthy(tmp_path: Path, tiny_models_dir: Path,
                                           tiny_rerank_export: None) -> None:
    """SIGTERM with a generation in flight: while the pool drains, /ready is 503 and
    /health 200 (asked on any of the front door's connections: the daemon takes no new
    one), new work is 503 shutting_down, and the work in flight gets its answer."""
    daemon, base = http_daemon(tmp_path, tiny_models_dir)
    sdk = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    try:
        sdk.completions.create(model="counter", prompt="x", max_tokens=1)  # warm
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(sdk.completions.create, model="counter", prompt="x",
                                    max_tokens=60)  # 3 s; shutdown_timeout_s is 5
            wait_running(daemon, "counter")
            daemon.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 2
            while (ready := httpx.get(base + "/ready")).status_code == 200:
                assert time.monotonic() < deadline, "still ready 2 s after SIGTERM"
                time.sleep(0.05)
            health = [httpx.get(base + "/health", headers={"Authorization": f"Bearer p{i}"})
                      for i in range(8)]  # each another client: another connection's turn
            with pytest.raises(openai.InternalServerError) as refused:
                sdk.embeddings.create(model="slow-embed", input="x")
            answered = in_flight.result(timeout=30)
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
        assert [h.status_code for h in health] == [200] * 8
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "shutting_down"
        assert answered.usage.completion_tokens == 60
        assert daemon.process.wait(30) == 0
    finally:
        daemon.stop()


def test_the_front_doors_process_is_started_again(served: tuple[Daemon, str]) -> None:
    front = served[0].running("modelpool.supervisor.httpapi.serve")
    assert len(front) == 1
    os.kill(front[0].pid, signal.SIGKILL)
    wait_for_http(served[1], served[0], timeout_s=20)
    assert httpx.get(served[1] + "/v1/models", headers=AUTH).status_code == 200


def _serve(tmp_path: Path, config: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "c.toml").write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "modelpool.supervisor.cli", "serve", "--config",
         str(tmp_path / "c.toml")], cwd=ROOT, env=daemon_env(fresh_socket_path()),
        capture_output=True, text=True, timeout=60)


def test_beyond_loopback_without_keys_refuses_to_start(tmp_path: Path) -> None:
    done = _serve(tmp_path, f'[http]\nlisten = "0.0.0.0:{free_port()}"\n')
    assert done.returncode == 2
    assert "api_keys" in done.stderr and "Traceback" not in done.stderr


def test_a_taken_port_refuses_to_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _serve(tmp_path, f'[http]\nlisten = "127.0.0.1:{taken.getsockname()[1]}"\n')
    assert done.returncode == 2 and "in use" in done.stderr


def test_in_loop_serves_the_same_api(make_daemon: object, tmp_path: Path) -> None:
    port = free_port()
    daemon = make_daemon(f"""
        [http]
        listen = "127.0.0.1:{port}"
        in_loop = true
    """)  # type: ignore[operator]
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)
    got = httpx.post(base + "/v1/embeddings", json={"input": "x"}, timeout=60).json()
    with daemon.client() as c:
        np.testing.assert_allclose(got["data"][0]["embedding"], c.embed("x"), atol=1e-6)
    assert daemon.running("httpapi.serve") == []


def _maps_uvloop(process: psutil.Process) -> bool:
    return any("uvloop" in m.path for m in process.memory_maps(grouped=True))


@pytest.mark.parametrize("event_loop", ["auto", "asyncio"])
def test_the_daemon_and_its_front_door_run_the_loop_configured(
        make_daemon: object, event_loop: str) -> None:
    want_uvloop = event_loop == "auto" and importlib.util.find_spec("uvloop") is not None
    port = free_port()
    daemon = make_daemon(f"""
        [daemon]
        event_loop = "{event_loop}"
        [http]
        listen = "127.0.0.1:{port}"
    """)  # type: ignore[operator]
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)
    openai_client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    got = openai_client.embeddings.create(model=MINILM, input="x").data[0].embedding
    with daemon.client() as c:
        np.testing.assert_allclose(got, c.embed("x"), atol=1e-6)
    assert f"{'uvloop' if want_uvloop else 'asyncio'} loop)" in daemon.log()
    front = daemon.running("httpapi.serve")
    assert len(front) == 1
    assert _maps_uvloop(psutil.Process(daemon.process.pid)) == want_uvloop
    assert _maps_uvloop(front[0]) == want_uvloop
