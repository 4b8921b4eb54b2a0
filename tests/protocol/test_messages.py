"""Wire messages: round trips, golden bytes, validation and the worker-pipe messages."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest

from modelpool.protocol import pipes
from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.jobs import (
    CancelJob,
    Completion,
    Follow,
    ForgetJob,
    GetStats,
    JobInfo,
    JobKey,
    JobQuery,
    JobReply,
    JobResult,
    JobsReply,
    ListJobs,
    PoolStats,
    Retrieve,
    StatsReply,
    Submit,
)
from modelpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Cancel,
    ChatMessage,
    Chunk,
    Describe,
    Detokenize,
    Detokenized,
    Embed,
    Embeddings,
    EmbedImage,
    End,
    Error,
    Generate,
    GenerateImage,
    GetStatus,
    Hello,
    Image,
    ImageInput,
    ImageProgress,
    ListModels,
    LoadModel,
    ModelInfo,
    ModelsReply,
    ReloadConfig,
    Rerank,
    Sampling,
    Scores,
    StatusReply,
    StopDaemon,
    Tokenize,
    Tokenized,
    UnloadModel,
    Welcome,
    encoder,
)
from modelpool.protocol.status import MemoryStatus, ModelStatus, PoolStatus, WorkerStatus
from modelpool.protocol.wire import ClientMessage, ServerMessage, client_decoder, server_decoder

CLIENT_MESSAGES: list[msgspec.Struct] = [
    Hello(protocol_version=PROTOCOL_VERSION, client="pytest"),
    Embed(id=1, texts=["a", "b"], model="minilm", priority="high", timeout_s=2.5,
          deadline_s=1.0),
    Generate(id=2, prompt="Once", sampling=Sampling(max_tokens=8, temperature=0.0, top_p=0.9,
                                                    seed=3, stop=["\n"], ignore_eos=True),
             raw=True, priority="batch"),
    Generate(id=3, messages=[ChatMessage(role="system", content="be brief"),
                             ChatMessage(role="user", content="hi")]),
    EmbedImage(id=9, images=[ImageInput(data=b"\x89PNG"), ImageInput(url="https://x/y.png")]),
    Describe(id=10, image=ImageInput(data=b"\xff\xd8"), prompt="what is it?",
             sampling=Sampling(seed=1)),
    GenerateImage(id=11, prompt="a cat", steps=4, width=64, height=64, seed=7,
                  preview_every=2),
    Rerank(id=12, query="what is it?", documents=["a cat", "a dog"], model="tiny-rerank"),
    Tokenize(id=20, messages=[ChatMessage(role="user", content="hi")], tools=[{"type": "x"}],
             token_strs=True),
    Detokenize(id=21, tokens=[1, 2, 3], model="tiny-llm"),
    Cancel(id=2),
    GetStatus(id=4),
    ListModels(id=5),
    LoadModel(id=6, model="minilm", workers=3),
    UnloadModel(id=7, model="minilm"),
    StopDaemon(id=8),
    ReloadConfig(id=20),
    Submit(id=13, request=Embed(id=0, texts=["a"]), single=True),
    Submit(id=13, request=Generate(id=0, prompt="a"), stream=True),
    Follow(id=13, key="k" * 32),
    Retrieve(id=14, key="k" * 22, timeout_s=2.5),
    JobQuery(id=15, key="k" * 22),
    CancelJob(id=16, key="k" * 22),
    ForgetJob(id=17, key="k" * 22),
    ListJobs(id=18, limit=5),
    GetStats(id=19),
]


def _status() -> PoolStatus:
    worker = WorkerStatus(worker_id=1, pid=1234, state="busy", inflight=2, started_s_ago=3.5,
                          idle_s=None, uss_mb=101.5, last_heartbeat_s=0.2)
    model = ModelStatus(key="m", capability="text_embedding", state="ready", queued=1,
                        running=2, completed=3, failed=4, workers=[worker], last_error="boom")
    memory = MemoryStatus(budget_mb=800.0, used_mb=210.0, total_mb=1000.0, available_mb=600.0)
    return PoolStatus(pid=42, version="0.1.0", uptime_s=9.5, socket="/tmp/s.sock",
                      shutting_down=False, models=[model], memory=memory)


SERVER_MESSAGES: list[msgspec.Struct] = [
    Welcome(protocol_version=1, server_version="0.1.0", max_frame_bytes=1 << 20,
            default_models={"text_embedding": "minilm"}),
    Embeddings(id=1, data=b"\x00" * 8, shape=[2, 1], model="minilm"),
    Scores(id=12, data=b"\x00" * 8, shape=[2], model="tiny-rerank"),
    Tokenized(id=20, tokens=[1, 2], token_strs=["a", "b"], max_model_len=2048, model="m"),
    Detokenized(id=21, prompt="hi", model="tiny-llm"),
    Chunk(id=2, seq=0, text="Hel"),
    ImageProgress(id=11, seq=0, step=1, total_steps=4, preview_png=b"\x89PNG"),
    Image(id=11, png=b"\x89PNG", width=64, height=64, seed=7, model="sd"),
    End(id=2, finish_reason="length", prompt_tokens=3, completion_tokens=8, model="llm"),
    Error(id=None, code=ErrorCode.BAD_REQUEST, message="undecodable frame"),
    Error(id=9, code=ErrorCode.QUEUE_FULL, message="full", retry_after_s=0.5),
    StatusReply(id=3, status=_status()),
    ModelsReply(id=4, models=[ModelInfo(key="m", capability="vision", aliases=["v"],
                                        source="path:/m", default=True, state="cold")]),
    Ack(id=5, message="loaded"),
    JobKey(id=13, key="k" * 22),
    JobResult(id=14, key="k" * 22, single=True,
              result=Completion(text="Once", finish_reason="stop", completion_tokens=1)),
    JobReply(id=15, job=JobInfo(key="k", op="embed", model="m", priority="normal",
                                state="done", submitted_at=1.5, finished_at=2.5)),
    JobsReply(id=18, jobs=[]),
    StatsReply(id=19, stats=PoolStats(workers=2, busy_workers=1, active_jobs=1,
                                      queued_jobs=3, memory_used_mb=10.0,
                                      memory_budget_mb=100.0, completed=5, failed=0,
                                      stored_results=1, mailbox_bytes=64)),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_message_round_trip(msg: msgspec.Struct) -> None:
    decoded = client_decoder.decode(encoder.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_server_message_round_trip(msg: msgspec.Struct) -> None:
    decoded = server_decoder.decode(encoder.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize(("union", "cases"), [(ClientMessage, CLIENT_MESSAGES),
                                              (ServerMessage, SERVER_MESSAGES)])
def test_every_union_member_has_a_round_trip_case(union: Any, cases: list[Any]) -> None:
    # A message type added to a Union without a round-trip case above fails here.
    assert set(typing.get_args(union)) == {type(m) for m in cases}


def test_nested_status_survives_the_wire() -> None:
    decoded = server_decoder.decode(encoder.encode(StatusReply(id=3, status=_status())))
    assert isinstance(decoded, StatusReply)
    worker = decoded.status.models[0].workers[0]
    assert isinstance(worker, WorkerStatus) and worker.uss_mb == 101.5 and worker.idle_s is None
    assert isinstance(decoded.status.memory, MemoryStatus)
    assert decoded.status.memory.available_mb == 600.0


def test_a_tenant_is_a_short_name() -> None:
    named = client_decoder.decode(encoder.encode(Embed(id=1, texts=["a"], tenant="t" * 64)))
    assert named.tenant == "t" * 64
    with pytest.raises(msgspec.ValidationError, match="tenant"):
        client_decoder.decode(encoder.encode(Embed(id=1, texts=["a"], tenant="t" * 65)))


def test_server_decoder_refuses_client_messages() -> None:
    # The two directions are separate Unions: a daemon never accepts its own replies.
    with pytest.raises(msgspec.ValidationError):
        client_decoder.decode(encoder.encode(Ack(id=1)))
    with pytest.raises(msgspec.ValidationError):
        server_decoder.decode(encoder.encode(Cancel(id=1)))


# The wire is an API: clients in other languages and older Python clients encode these
# bytes by hand. A refactor that renames a field, a tag or changes omit_defaults would
# still round-trip in Python but break every deployed client, so pin exact bytes.
HELLO_GOLDEN = "83a26f70a568656c6c6fb070726f746f636f6c5f76657273696f6e01a6636c69656e74a178"
EMBEDDINGS_GOLDEN = (
    "84a26f70aa656d62656464696e6773a2696407a464617461c4040000803fa57368617065920101"
)


def test_golden_bytes_hello() -> None:
    assert encoder.encode(Hello(protocol_version=1, client="x")).hex() == HELLO_GOLDEN
    assert client_decoder.decode(bytes.fromhex(HELLO_GOLDEN)) == Hello(protocol_version=1,
                                                                       client="x")


def test_golden_bytes_embeddings() -> None:
    msg = Embeddings(id=7, data=b"\x00\x00\x80\x3f", shape=[1, 1])
    assert encoder.encode(msg).hex() == EMBEDDINGS_GOLDEN
    assert server_decoder.decode(bytes.fromhex(EMBEDDINGS_GOLDEN)) == msg


def test_defaults_are_omitted_on_the_wire() -> None:
    raw = msgspec.msgpack.decode(encoder.encode(Embed(id=1, texts=["a"])))
    assert raw == {"op": "embed", "id": 1, "texts": ["a"]}
    raw = msgspec.msgpack.decode(encoder.encode(Embed(id=1, texts=["a"], priority="low")))
    assert raw["priority"] == "low"


def _raw(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "payload",
    [
        _raw(op="embed", id=1, texts=[]),
        _raw(op="generate", id=1, prompt="x", sampling={"max_tokens": 0}),
        _raw(op="generate", id=1, prompt="x", sampling={"top_p": 0}),
        _raw(op="generate", id=1, prompt="x", sampling={"temperature": -1}),
        _raw(op="embed", id=-1, texts=["a"]),
        _raw(op="embed", id=1, texts=["a"], priority="urgent"),
        _raw(op="embed", id=1, texts=["a"], timeout_s=0),
        _raw(op="teleport", id=1),
        _raw(id=1, texts=["a"]),
        _raw(op="embed", texts=["a"]),
    ],
    ids=["empty-texts", "max-tokens-0", "top-p-0", "temperature-neg", "negative-id",
         "unknown-priority", "timeout-0", "unknown-op", "no-op", "no-id"],
)
def test_invalid_requests_are_refused(payload: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        client_decoder.decode(payload)


def test_boundary_values_are_accepted() -> None:
    # The counterpart of the refusals above: the limits themselves are legal.
    msg = client_decoder.decode(_raw(op="generate", id=0, prompt="x", sampling={
        "max_tokens": 1, "top_p": 1, "temperature": 0}))
    assert isinstance(msg, Generate)
    assert msg.sampling.max_tokens == 1 and msg.sampling.temperature == 0


def test_undecodable_bytes_raise_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        client_decoder.decode(b"\xc1")


# ---- worker pipes ------------------------------------------------------------------


def test_work_round_trip_with_embed_and_generate() -> None:
    work = pipes.Work(items=[
        pipes.WorkItem(job_id=10, request=Embed(id=1, texts=["a", "b"])),
        pipes.WorkItem(job_id=11, request=Generate(id=2, prompt="hi",
                                                   sampling=Sampling(max_tokens=4))),
    ])
    decoded = pipes.to_worker_decoder.decode(encoder.encode(work))
    assert decoded == work
    assert isinstance(decoded.items[0].request, Embed)
    assert isinstance(decoded.items[1].request, Generate)


@pytest.mark.parametrize("msg", [pipes.Abort(job_id=3), pipes.Shutdown(), pipes.Threads(count=2)],
                         ids=lambda m: type(m).__name__)
def test_to_worker_round_trip(msg: msgspec.Struct) -> None:
    decoded = pipes.to_worker_decoder.decode(encoder.encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


@pytest.mark.parametrize(
    "msg",
    [
        pipes.Ready(pid=99, load_s=0.25, uss_mb=100.0, info={"dim": 384}),
        pipes.Ready(pid=99, load_s=0.25),
        pipes.LoadFailed(cause="OSError: no weights"),
        pipes.WantWork(),
        Embeddings(id=10, data=b"\x00" * 4, shape=[1, 1]),
        Chunk(id=11, seq=2, text="x"),
        End(id=11, finish_reason="stop"),
        Error(id=11, code=ErrorCode.MODEL_ERROR, message="raised"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_from_worker_round_trip(msg: msgspec.Struct) -> None:
    decoded = pipes.from_worker_decoder.decode(encoder.encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


def test_heartbeat_is_a_compact_array() -> None:
    payload = encoder.encode(pipes.Heartbeat(seq=5, progress=17, tokens=40, threads=2))
    assert msgspec.msgpack.decode(payload) == [5, 17, 40, 2]  # array_like: no field names
    assert pipes.heartbeat_decoder.decode(payload) == pipes.Heartbeat(seq=5, progress=17,
                                                                      tokens=40, threads=2)
    # A beat without the token count or the threads (an older worker's) still decodes.
    old = msgspec.msgpack.encode([5, 17])
    assert pipes.heartbeat_decoder.decode(old) == pipes.Heartbeat(seq=5, progress=17)
