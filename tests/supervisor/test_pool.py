"""Pool policy and bookkeeping, driven as the event loop would, with fake workers.

The fakes live in conftest.py: the test plays each worker through
pool.on_worker_message / pool.on_worker_exit and each client through a FakeSink.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.fields import RequestDefaults
from modelpool.protocol.messages import (
    ChatMessage,
    Chunk,
    Embed,
    Embeddings,
    End,
    Generate,
    Sampling,
    Tokenize,
)
from modelpool.registry.spec import ModelSpec
from modelpool.supervisor.cli import _model_text
from modelpool.supervisor.status import build_status
from modelpool.supervisor.workers import WorkerState

if TYPE_CHECKING:
    from conftest import Harness

MakeHarness = Callable[..., "Harness"]


# ---- 1. lazy activation -------------------------------------------------------------


async def test_no_worker_until_first_request_then_cold_start_of_that_model_only(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    await h.settle()
    assert h.launcher.started == []

    h.embed(sink, ["hello"], id=77)
    await h.settle()

    assert [w.model_key for w in h.launcher.started] == ["emb", "emb"]
    assert [s.spec.key for s in h.launcher.settings] == ["emb", "emb"]
    assert h.workers("gen") == []
    assert all(w.state is WorkerState.LOADING for w in h.launcher.started)
    assert sink.messages == []


async def test_request_goes_to_first_ready_worker_and_reply_carries_client_id(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.embed(sink, ["hello"], id=77)
    await h.settle()
    first, second = h.workers("emb")

    h.ready(second)  # the second one to be started is the first to be ready
    assert h.works(first) == []
    (work,) = h.works(second)
    ((job_id, request),) = h.items(work)
    assert request.texts == ["hello"] and job_id != 77

    h.reply_embeddings(second, job_id, 0.5, 0.25)
    (reply,) = sink.messages
    assert isinstance(reply, Embeddings)
    assert (reply.id, reply.model, reply.shape) == (77, "emb", [1, 2])
    assert sink.jobs == {}
    assert h.pool.models["emb"].metrics.by_priority["normal"].completed == 1


# ---- 3. streaming -------------------------------------------------------------------


async def test_stream_chunks_forwarded_in_order_and_second_end_ignored(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    client_id = h.generate(sink, "tell me", id=9)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    ((job_id, request),) = h.items(h.works(worker)[0])
    assert isinstance(request, Generate) and request.prompt == "tell me"

    for seq, text in enumerate(["a", "b", "c"]):
        h.chunk(worker, job_id, seq, text)
    h.end(worker, job_id)
    h.end(worker, job_id)
    h.chunk(worker, job_id, 3, "late")

    assert sink.messages[:3] == [Chunk(id=client_id, seq=s, text=t)
                                 for s, t in enumerate(["a", "b", "c"])]
    (final,) = sink.finals(client_id)
    assert isinstance(final, End)
    assert (final.finish_reason, final.model, final.completion_tokens) == ("stop", "gen", 3)
    assert len(sink.messages) == 4
    assert h.pool.models["gen"].metrics.by_priority["normal"].completed == 1


# ---- 4. admission -------------------------------------------------------------------


@pytest.mark.parametrize(("request_", "code"), [
    (Embed(id=1, model="nope", texts=["x"]), ErrorCode.UNKNOWN_MODEL),
    (Embed(id=1, model="gen", texts=["x"]), ErrorCode.WRONG_CAPABILITY),
    (Generate(id=1, model="emb", prompt="x"), ErrorCode.WRONG_CAPABILITY),
    (Generate(id=1, model="gen"), ErrorCode.BAD_REQUEST),
    (Tokenize(id=1, model="emb", prompt="x"), ErrorCode.WRONG_CAPABILITY),
    (Tokenize(id=1, model="gen"), ErrorCode.BAD_REQUEST),
])
async def test_admission_errors_reply_at_once_and_start_nothing(
        make_harness: MakeHarness, request_: Embed | Generate | Tokenize,
        code: ErrorCode) -> None:
    h = make_harness()
    sink = h.sink()
    h.pool.submit(sink, request_)
    await h.settle()
    assert sink.only_error(1).code is code
    assert h.launcher.started == []
    assert sink.jobs == {}


async def test_generate_with_messages_and_no_prompt_is_accepted(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.pool.submit(sink, Generate(id=1, model="gen",
                                 messages=[ChatMessage(role="user", content="hi")]))
    await h.settle()
    assert sink.messages == []
    assert len(h.workers("gen")) == 2


async def test_duplicate_in_flight_id_on_one_sink_is_bad_request(
        make_harness: MakeHarness) -> None:
    h = make_harness()
    sink, other = h.sink("a"), h.sink("b")
    h.embed(sink, ["x"], id=5)
    await h.settle()
    started = len(h.launcher.started)

    h.embed(sink, ["y"], id=5)
    h.embed(other, ["z"], id=5)  # ids are per connection
    await h.settle()

    error = sink.only_error(5)
    assert error.code is ErrorCode.BAD_REQUEST and "5" in error.message
    assert other.messages == [] and 5 in other.jobs
    assert len(h.launcher.started) == started
    assert len(h.pool.models["emb"].queue) == 2


async def test_shutting_down_refuses_new_work(make_harness: MakeHarness) -> None:
    h = make_harness()
    sink = h.sink()
    h.pool.shutting_down = True
    h.embed(sink, ["x"], id=3)
    await h.settle()
    assert sink.only_error(3).code is ErrorCode.SHUTTING_DOWN
    assert h.launcher.started == []


# ---- 10. scale up -------------------------------------------------------------------


async def test_scale_up_one_at_a_time_when_all_busy_up_to_the_cap(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_workers_per_model=3)
    sink = h.sink()
    h.embed(sink, ["1"])
    await h.settle()
    a, b = h.workers("emb")
    h.ready(a)
    h.ready(b)
    h.embed(sink, ["2"])
    assert a.state is WorkerState.BUSY and b.state is WorkerState.BUSY

    h.embed(sink, ["3"])
    await h.settle()
    assert len(h.launcher.started) == 3  # all busy and work waits: +1
    h.embed(sink, ["4"])
    await h.settle()
    assert len(h.launcher.started) == 3  # one start at a time

    c = h.workers("emb")[2]
    h.ready(c)
    assert [r.texts for _, r in h.items(h.works(c)[0])] == [["3"], ["4"]]
    h.embed(sink, ["5"])
    await h.settle()
    assert len(h.launcher.started) == 3  # at max_workers_per_model
    assert len(h.pool.models["emb"].queue) == 1


async def test_scale_up_when_work_still_waits_after_cold_start_workers_took_theirs(
        make_harness: MakeHarness) -> None:
    h = make_harness(max_workers_per_model=4)
    sink = h.sink()
    for n in range(3):
        h.generate(sink, f"p{n}")  # a burst while the model loads
    await h.settle()
    a, b = h.workers("gen")
    h.ready(a)
    h.ready(b)
    assert a.state is WorkerState.BUSY and b.state is WorkerState.BUSY
    assert len(h.pool.models["gen"].queue) == 1
    await h.settle()

    assert len(h.workers("gen")) == 3


async def test_scale_up_respects_per_model_max_workers(make_harness: MakeHarness) -> None:
    spec = ModelSpec(key="emb", capability="text_embedding", path="/nonexistent",
                     max_workers=1)
    h = make_harness(models=[spec])
    sink = h.sink()
    h.embed(sink, ["1"])
    h.embed(sink, ["2"])
    await h.settle()
    assert len(h.launcher.started) == 1
    h.ready(h.workers("emb")[0])
    h.embed(sink, ["3"])
    await h.settle()
    assert len(h.launcher.started) == 1


@pytest.mark.parametrize("each_its_own_read", [False, True])
async def test_work_queued_behind_waiting_work_with_no_free_worker_is_not_reconciled(
        make_harness: MakeHarness, monkeypatch: pytest.MonkeyPatch,
        each_its_own_read: bool) -> None:
    """Nothing the policy reads changed and nothing can be dispatched: the reconcile of
    the next freed slot takes it, with everything queued meanwhile. Nor does the end of
    a read whose requests are all such (16 clients' reads bring a few requests each)."""
    h = make_harness(max_workers_per_model=2)
    sink = h.sink()
    h.embed(sink, ["1"])
    await h.settle()
    a, b = h.workers("emb")
    h.ready(a)
    h.ready(b)
    h.embed(sink, ["2"])
    reconciles = []
    real = h.pool.reconcile
    monkeypatch.setattr(h.pool, "reconcile", lambda m: (reconciles.append(m.key), real(m)))
    for n in range(3, 8):
        with h.pool.admitting() if each_its_own_read else contextlib.nullcontext():
            h.embed(sink, [str(n)])
    assert reconciles == ["emb"]  # the first found the queue empty
    h.reply_embeddings(a, h.job_ids(a)[0], 1.0)
    h.want_work(a)
    assert [r.texts for _, r in h.items(h.works(a)[1])] == [[str(n)] for n in range(3, 8)]


# ---- defaults --------------------------------------------------------------------------


NO_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


async def _samplings(h: Harness, *requests: dict[str, Any]) -> list[Sampling]:
    """The sampling each generate request (its keyword arguments) reached the worker with,
    sent one after another."""
    sink = h.sink()
    for i, fields in enumerate(requests):
        h.generate(sink, f"p{i}", **fields)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    samplings = []
    for work in range(len(requests)):
        ((job_id, request),) = h.items(h.works(worker)[work])
        samplings.append(request.sampling)
        h.end(worker, job_id)
        h.want_work(worker)
    return samplings


async def test_unset_parameters_reach_the_worker_as_the_configured_defaults(
        make_harness: MakeHarness) -> None:
    h = make_harness(defaults=RequestDefaults(max_tokens=9, temperature=0.0))
    first, second = await _samplings(h, {}, {"max_tokens": 2, "temperature": 0.7, "seed": 1})
    assert first == Sampling(max_tokens=9, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                             **NO_PENALTIES)
    assert second == Sampling(max_tokens=2, temperature=0.7, top_p=1.0, top_k=0, min_p=0.0,
                              seed=1, **NO_PENALTIES)


def _recommending(tmp_path: Path, config: object, read: bool = True) -> ModelSpec:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return ModelSpec(key="gen", capability="text_to_text", path=str(tmp_path),
                     weights_mb=10, per_worker_mb=10, generation_config=read)


async def test_what_a_models_generation_config_recommends_comes_before_the_defaults(
        make_harness: MakeHarness, tmp_path: Path) -> None:
    recommends = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True,
                  "repetition_penalty": 1.05, "max_new_tokens": 33, "bos_token_id": 1}
    penalties = {**NO_PENALTIES, "repetition_penalty": 1.05}
    h = make_harness(models=[_recommending(tmp_path, recommends)],
                     defaults=RequestDefaults(max_tokens=9, min_p=0.05))
    # What a request sets wins.
    first, second = await _samplings(h, {}, {"temperature": 0.0, "top_k": 0,
                                             "repetition_penalty": 1.0, "max_tokens": 4})
    assert first == Sampling(max_tokens=33, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                             **penalties)
    assert second == Sampling(max_tokens=4, temperature=0.0, top_p=0.9, top_k=0, min_p=0.05,
                              **NO_PENALTIES)
    status = msgspec.to_builtins(build_status(h.pool, "/s", h.clock.now()))
    (gen,) = [m for m in status["models"] if m["key"] == "gen"]
    assert "    unless a request sets them: temperature 0.6, top_p 0.9, top_k 20, " \
           "repetition_penalty 1.05, max_tokens 33 (its generation_config.json)" \
           in _model_text(gen)


@pytest.mark.parametrize(("config", "read"), [
    ({"temperature": 0.6}, False),  # generation_config = false: the daemon's defaults
    ({"temperature": -1, "top_k": "many"}, True),  # out of range: left out
    ([1, 2], True),
])
async def test_a_generation_config_not_read_or_not_valid_leaves_the_defaults(
        make_harness: MakeHarness, tmp_path: Path, config: object, read: bool) -> None:
    h = make_harness(models=[_recommending(tmp_path, config, read)])
    (sampling,) = await _samplings(h, {})
    assert sampling == Sampling(max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                **NO_PENALTIES)


async def test_an_unset_parameter_and_its_default_are_the_same_request(
        make_harness: MakeHarness) -> None:
    """Dedup compares requests after defaults are filled in."""
    h = make_harness(defaults=RequestDefaults(max_tokens=9))
    sink = h.sink()
    h.generate(sink, "same", temperature=0)
    h.generate(sink, "same", temperature=0, max_tokens=9)
    await h.settle()
    worker = h.workers("gen")[0]
    h.ready(worker)
    assert len(h.job_ids(worker)) == 1
    assert h.pool.models["gen"].metrics.by_priority["normal"].deduplicated == 1


@pytest.mark.parametrize("chars", [10, 5000], ids=["small: its own key", "large: digested"])
async def test_identical_embeds_join_and_differing_ones_do_not(
        make_harness: MakeHarness, chars: int) -> None:
    h = make_harness()
    sink = h.sink()
    text = "x" * chars
    same = [h.embed(sink, [text], priority=priority) for priority in ("normal", "high")]
    other = h.embed(sink, [text[:-1] + "y"])
    await h.settle()
    worker = h.workers("emb")[0]
    h.ready(worker)
    assert len(h.job_ids(worker)) == 2
    for job_id in h.job_ids(worker):
        h.reply_embeddings(worker, job_id, float(job_id))
    replies = {reply.id: reply.data for reply in sink.messages}
    assert set(replies) == {*same, other}
    assert replies[same[0]] == replies[same[1]] != replies[other]
    assert h.pool.book.index == {}  # emptied as the jobs end, whatever their keys' form
