"""A reload and the HTTP front door, served by its own process or from the supervisor's
loop: new API keys (api_key_file read again) and request limits apply at once, a front
door started again keeps them, a new address or new connection settings are taken over
by a new front door while the models stay loaded, a port already taken or keys removed
from an address beyond loopback are refused, and answers name the default model of
now."""

from __future__ import annotations

import os
import signal
import socket
import textwrap
import threading
import time
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest
from conftest import Daemon, MakeDaemon, model_entry, worker_pids
from http_helpers import free_port, wait_for_http

from modelpool.protocol.errors import ErrorCode, PoolError

SLOW = model_entry("slow", run_s=0.2, max_workers=1)  # a request in flight at a takeover
# A request in flight at a takeover that outlasts the 5 s a stop of the daemon gives.
SLOW_AND_LONG = SLOW + model_entry("long", run_s=6.0, max_workers=1)


def config(port: int, in_loop: bool, key_file: Path, extra: str = "",
           models: str = SLOW) -> str:
    return models + textwrap.dedent(f"""
        [http]
        listen = "127.0.0.1:{port}"
        in_loop = {str(in_loop).lower()}
        api_key_file = "{key_file}"
    """) + extra


def reload_to(daemon: Daemon, config_toml: str) -> str:
    (daemon.log_path.parent / "modelpool.toml").write_text(config_toml)
    with daemon.client() as c:
        return c.reload()


def embed_status(base: str, key: str, priority: str = "normal", model: str = "slow") -> int:
    return httpx.post(base + "/v1/embeddings", json={"input": "x", "model": model},
                      headers={"Authorization": f"Bearer {key}",
                               "X-Modelpool-Priority": priority}, timeout=30).status_code


def front_door_processes(daemon: Daemon) -> list[psutil.Process]:
    return daemon.running("httpapi.serve")


@pytest.mark.parametrize("in_loop", [False, True], ids=["own-process", "in-loop"])
def test_a_reload_rotates_keys_and_limits(make_daemon: MakeDaemon, tmp_path: Path,
                                          in_loop: bool) -> None:
    port, keys = free_port(), tmp_path / "keys"
    keys.write_text("first-key\n")
    daemon = make_daemon(config(port, in_loop, keys))
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)
    assert (embed_status(base, "first-key"), embed_status(base, "second-key")) == (200, 401)

    keys.write_text("# rotated\nsecond-key\n")
    assert reload_to(daemon, config(port, in_loop, keys)) == "[http] applied"
    assert (embed_status(base, "second-key"), embed_status(base, "first-key")) == (200, 401)

    capped = config(port, in_loop, keys, 'max_priority = "normal"\n')
    assert reload_to(daemon, capped) == "[http] applied"
    assert embed_status(base, "second-key", "high") == 403
    assert embed_status(base, "second-key", "normal") == 200

    if not in_loop:  # started again after a crash: with the settings of now
        (front,) = front_door_processes(daemon)
        os.kill(front.pid, signal.SIGKILL)
        front.wait(10)
        wait_for_http(base, daemon, timeout_s=20)
        assert embed_status(base, "second-key", "high") == 403
        assert embed_status(base, "first-key") == 401
    assert reload_to(daemon, capped) == "no change"


def serving(make_daemon: MakeDaemon, tmp_path: Path, in_loop: bool,
            models: str = SLOW) -> tuple[Daemon, int, Path]:
    """A daemon whose front door answers on a free port, with one key: "the-key"."""
    port, keys = free_port(), tmp_path / "keys"
    keys.write_text("the-key\n")
    daemon = make_daemon(config(port, in_loop, keys, models=models))
    wait_for_http(f"http://127.0.0.1:{port}", daemon)
    return daemon, port, keys


def front_doors_become(daemon: Daemon, count: int, timeout_s: float = 30) -> list[int]:
    """The pids of the front door processes, once there are count of them: one taken
    over exits when it has answered what it had in flight."""
    deadline = time.monotonic() + timeout_s
    while len(fronts := front_door_processes(daemon)) != count:
        assert time.monotonic() < deadline, [p.cmdline() for p in fronts]
        time.sleep(0.05)
    return [p.pid for p in fronts]


def refused_connection(base: str) -> bool:
    try:
        httpx.get(base + "/health", timeout=5)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.parametrize("in_loop", [False, True], ids=["own-process", "in-loop"])
def test_a_new_address_takes_over_and_the_models_stay(make_daemon: MakeDaemon,
                                                      tmp_path: Path, in_loop: bool) -> None:
    daemon, first_port, keys = serving(make_daemon, tmp_path, in_loop, SLOW_AND_LONG)
    first = f"http://127.0.0.1:{first_port}"
    assert embed_status(first, "the-key") == 200
    with daemon.client() as c:
        (worker,) = worker_pids(c, "slow")

    port = free_port()
    assert reload_to(daemon, config(port, in_loop, keys, "max_clients = 4\n",
                                    SLOW_AND_LONG)) == "[http] applied"
    base = f"http://127.0.0.1:{port}"
    assert embed_status(base, "the-key") == 200
    assert refused_connection(first)  # let go when the reload answered
    fronts = front_doors_become(daemon, 0 if in_loop else 1)

    # The same address with other connection settings: a new front door takes it over.
    # Three clients ask all along (requests in flight at the takeover: the model serves
    # one at a time, 0.2 s each), one request outlasts a stop's 5 s (four clients: the
    # old front door's max_clients), and every request is answered.
    answers: list[int | str] = []
    done = threading.Event()

    def ask(model: str = "slow") -> None:
        try:
            answers.append(embed_status(base, "the-key", model=model))
        except httpx.HTTPError as exc:
            answers.append(repr(exc))

    def ask_all_along() -> None:
        while not done.is_set():
            ask()

    askers = [threading.Thread(target=ask_all_along) for _ in range(3)]
    askers.append(threading.Thread(target=ask, args=("long",)))
    for asker in askers:
        asker.start()
    try:
        time.sleep(0.5)
        assert reload_to(daemon, config(port, in_loop, keys, "connections = 2\n",
                                        SLOW_AND_LONG)) == "[http] applied"
        time.sleep(1.5)  # the new front door's process up, and asked
    finally:
        done.set()
        for asker in askers:
            asker.join(60)
    assert set(answers) == {200} and len(answers) >= 8, answers
    if not in_loop:
        (front,) = front_doors_become(daemon, 1)
        assert front not in fronts

    with socket.socket() as taken:  # a port another program holds: nothing changes
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = config(taken.getsockname()[1], in_loop, keys, models=SLOW_AND_LONG)
        with pytest.raises(PoolError) as refused:
            reload_to(daemon, busy)
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert "goes on with the config it has" in refused.value.message
    assert embed_status(base, "the-key") == 200

    open_beyond = SLOW + f'[http]\nlisten = "0.0.0.0:{port}"\n'
    with pytest.raises(PoolError) as refused:
        reload_to(daemon, open_beyond)
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert "api_keys" in refused.value.message
    assert (embed_status(base, "the-key"), embed_status(base, "other")) == (200, 401)

    assert reload_to(daemon, SLOW_AND_LONG) == "[http] applied"  # no [http] listen: none
    assert refused_connection(base)
    assert front_door_processes(daemon) == []
    assert reload_to(daemon, config(port, in_loop, keys, models=SLOW_AND_LONG)) == \
        "[http] applied"
    wait_for_http(base, daemon)
    assert embed_status(base, "the-key") == 200
    with daemon.client() as c:  # the model stayed loaded throughout
        assert worker_pids(c, "slow") == [worker]


@pytest.mark.parametrize("in_loop", [False, True], ids=["own-process", "in-loop"])
def test_a_stop_bounds_a_front_door_taken_over_with_a_request_in_flight(
        make_daemon: MakeDaemon, tmp_path: Path, in_loop: bool) -> None:
    daemon, port, keys = serving(make_daemon, tmp_path, in_loop, SLOW_AND_LONG)
    base = f"http://127.0.0.1:{port}"
    fronts = front_doors_become(daemon, 0 if in_loop else 1)
    answers: list[int | str] = []

    def ask_long() -> None:
        try:
            answers.append(embed_status(base, "the-key", model="long"))
        except httpx.HTTPError as exc:
            answers.append(repr(exc))

    asker = threading.Thread(target=ask_long)
    asker.start()
    time.sleep(0.5)
    assert reload_to(daemon, config(port, in_loop, keys, "connections = 2\n",
                                    SLOW_AND_LONG)) == "[http] applied"
    fronts += front_doors_become(daemon, 0 if in_loop else 2)
    started = time.monotonic()
    assert daemon.stop() == 0, daemon.log()
    assert time.monotonic() - started < 15  # the pool's drain, then the front doors' 5 s
    assert not [pid for pid in fronts if psutil.pid_exists(pid)]  # gone with the daemon
    asker.join(30)
    assert len(answers) == 1 and answers != [200], answers  # cut: it ran past the stop


def test_a_new_frame_cap_starts_a_front_door_whose_links_and_body_cap_follow_it(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    daemon, port, keys = serving(make_daemon, tmp_path, in_loop=False)
    base = f"http://127.0.0.1:{port}"
    (front,) = front_door_processes(daemon)

    def embed(text: str) -> int:
        return httpx.post(base + "/v1/embeddings", json={"input": text, "model": "slow"},
                          headers={"Authorization": "Bearer the-key"}, timeout=30).status_code

    big = "word " * 2000  # ~10 KB
    assert embed(big) == 200
    capped = config(port, False, keys, "[daemon]\nmax_frame_bytes = 4096\n")
    assert reload_to(daemon, capped) == "[daemon], [http] applied"
    assert (embed(big), embed("small")) == (413, 200)
    assert [p.pid for p in front_door_processes(daemon)] != [front.pid]


def test_an_answer_names_the_default_model_of_now(make_daemon: MakeDaemon,
                                                  tmp_path: Path) -> None:
    port, keys = free_port(), tmp_path / "keys"
    keys.write_text("the-key\n")
    first = SLOW.replace('capability = "text_embedding"',
                         'capability = "text_embedding"\n        default = true')
    second = model_entry("other").replace(
        'capability = "text_embedding"', 'capability = "text_embedding"\n        default = true')
    daemon = make_daemon(config(port, False, keys, "", models=first + model_entry("other")))
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)

    def answered_by() -> str:
        got = httpx.post(base + "/v1/embeddings", json={"input": "x"}, timeout=30,
                         headers={"Authorization": "Bearer the-key"})
        assert got.status_code == 200, got.text
        return str(got.json()["model"])

    assert answered_by() == "slow"
    summary = reload_to(daemon, config(port, False, keys, "", models=SLOW + second))
    assert summary == "updated: slow, other"  # the default moved: no [http] change of its own
    assert answered_by() == "other"
