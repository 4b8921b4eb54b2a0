"""tokenize and detokenize through a real daemon on the tiny random-weight Llama: the ids
a generate request's prompt is read as, on both of the worker's paths (continuous
batching and one stream at a time), over the socket, the CLI and vLLM's HTTP paths."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec
import pytest
from conftest import ROOT, Daemon, start_daemon
from http_helpers import free_port, wait_for_http

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Tokenized

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"}]
KEYS = ("tiny-llm", "tiny-llm-one")  # its worker batches streams / runs one at a time


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory,
           tiny_models_dir: Path) -> Iterator[tuple[Daemon, str]]:
    port = free_port()
    daemon = start_daemon(tmp_path_factory.mktemp("tokenize"), f"""
        [http]
        listen = "127.0.0.1:{port}"
        [[models]]
        key = "tiny-llm"
        capability = "text_to_text"
        path = "{tiny_models_dir / 'tiny-llm'}"
        default = true
        [[models]]
        key = "tiny-llm-one"
        capability = "text_to_text"
        path = "{tiny_models_dir / 'tiny-llm'}"
        max_active_sequences = 1
        [[models]]
        key = "counter"
        capability = "text_to_text"
        loader = "mp_test_loaders:counting_generator"
    """)
    base = f"http://127.0.0.1:{port}"
    wait_for_http(base, daemon)
    yield daemon, base
    assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize("key", KEYS)
def test_tokenize_gives_the_ids_generate_reads(served: tuple[Daemon, str], key: str) -> None:
    with served[0].client() as c:
        tokenized = c.tokenize(CHAT, model=key, tools=TOOLS, token_strs=True)
        end = list(c.generate(CHAT, model=key, tools=TOOLS, max_tokens=1,
                              prompt_logprobs=0))[-1]
        raw = c.tokenize("Weather in Paris?", model=key, raw=True)
        back = c.detokenize(tokenized.tokens, model=key)
    assert isinstance(tokenized, Tokenized) and tokenized.model == key
    assert tokenized.tokens == [entry.token_id for entry in end.prompt_logprobs]
    assert len(tokenized.token_strs) == len(tokenized.tokens) == end.prompt_tokens
    assert tokenized.max_model_len == 2048  # the tiny model's context
    assert "get_weather" in back.prompt and back.prompt.count("Weather in Paris?") == 1
    assert "<|im_start|>system\nBe brief." in back.prompt  # special tokens kept
    assert back.prompt.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert len(raw.tokens) < len(tokenized.tokens)  # no template around it


def test_a_tokenize_is_answered_while_a_long_generation_runs(
        served: tuple[Daemon, str]) -> None:
    """No sequence of the model's decoder: answered between its steps, not after them."""
    with served[0].client() as streaming, served[0].client() as asking:
        stream = streaming.generate("go on", model="tiny-llm", max_tokens=3000,
                                    ignore_eos=True, temperature=0)
        next(iter(stream))
        done = threading.Event()
        threading.Thread(target=lambda: (list(stream), done.set()), daemon=True).start()
        assert asking.tokenize("hello", model="tiny-llm").tokens
        assert not done.is_set()
        assert done.wait(120)


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.detokenize([5000], model="tiny-llm"), "token 5000 is not one of"),
    (lambda c: c.tokenize("hi", model="counter"), "gives no tokenizer"),
    (lambda c: c.tokenize("", model="tiny-llm"), "a prompt or messages"),
    (lambda c: c.tokenize("hi", model="tiny-llm", raw=True, tools=TOOLS), "not with raw"),
])
def test_what_cannot_be_tokenized_is_refused_by_name(served: tuple[Daemon, str],
                                                     call: Any, message: str) -> None:
    with served[0].client() as c, pytest.raises(PoolError, match=message) as refused:
        call(c)
    assert refused.value.code is ErrorCode.BAD_REQUEST


def test_as_jobs_too(served: tuple[Daemon, str]) -> None:
    """As a job (and so, in a cluster, through a node that does not run the model)."""
    with served[0].client() as c:
        direct = c.tokenize(CHAT, model="tiny-llm-one")
        key = c.submit("tokenize", CHAT, model="tiny-llm-one")
        assert c.retrieve(key, timeout_s=60) == msgspec.structs.replace(direct, id=0)
        key = c.submit("detokenize", direct.tokens, model="tiny-llm-one")
        assert "Weather in Paris?" in c.retrieve(key, timeout_s=60).prompt


def test_vllms_http_paths_answer_as_the_socket_does(served: tuple[Daemon, str]) -> None:
    daemon, base = served
    with daemon.client() as c:
        chat = c.tokenize(CHAT, tools=TOOLS)
        prompt = c.tokenize("Weather in Paris?", raw=True, token_strs=True)
    with httpx.Client(base_url=base, timeout=60) as http:
        answer = http.post("/tokenize", json={"messages": CHAT, "tools": TOOLS}).json()
        assert answer == {"count": len(chat.tokens), "max_model_len": 2048,
                          "tokens": chat.tokens, "token_strs": None}
        answer = http.post("/tokenize", json={"prompt": "Weather in Paris?",
                                              "return_token_strs": True}).json()
        assert (answer["tokens"], answer["token_strs"]) == (prompt.tokens, prompt.token_strs)
        assert http.post("/detokenize", json={"tokens": prompt.tokens}).json() == {
            "prompt": "Weather in Paris?"}
        for body, param in (({"messages": CHAT, "add_generation_prompt": False},
                             "add_generation_prompt"),
                            ({"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
                            ({"messages": [{"role": "user", "content": [{
                                "type": "image_url", "image_url": {"url": "data:,"}}]}]},
                             "messages[0].content")):
            refused = http.post("/tokenize", json=body)
            assert (refused.status_code, refused.json()["error"]["param"]) == (400, param)


def test_the_cli_prints_them_as_json(served: tuple[Daemon, str]) -> None:
    def cli(*args: str) -> dict[str, Any]:
        run = subprocess.run([sys.executable, "-m", "modelpool.supervisor.cli", "--socket",
                              served[0].socket_path, *args], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    tokenized = cli("tokenize", "Weather in Paris?", "--raw", "--token-strs")
    assert tokenized["model"] == "tiny-llm" and len(tokenized["token_strs"]) == len(
        tokenized["tokens"])
    assert cli("detokenize", *map(str, tokenized["tokens"]))["prompt"] == "Weather in Paris?"
