"""The request-kind table: one row per request Struct, what it derives, and defaults."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest

from modelpool.protocol import kinds
from modelpool.protocol.fields import RequestDefaults, Structured
from modelpool.protocol.kinds import BY_OP, CAPABILITIES, KIND_OF, KINDS, merge_rows, with_defaults
from modelpool.protocol.messages import (
    ChatMessage,
    Describe,
    Detokenize,
    Embed,
    Embeddings,
    Generate,
    GenerateImage,
    ImageInput,
    Sampling,
    Tokenize,
    ToolCall,
    WorkRequest,
)


def test_every_request_struct_has_exactly_one_row() -> None:
    assert set(KIND_OF) == set(typing.get_args(WorkRequest))
    assert len(BY_OP) == len(KINDS) == len(KIND_OF)


def test_capabilities_are_derived_from_the_rows() -> None:
    assert CAPABILITIES["text_embedding"].batched
    assert not CAPABILITIES["text_embedding"].streaming
    assert CAPABILITIES["text_to_text"].streaming and not CAPABILITIES["text_to_text"].batched
    # An image-embedding model also answers text embeddings (its text tower).
    assert {k.op for k in CAPABILITIES["image_embedding"].kinds} == {"embed", "embed_image"}


def test_batched_kinds_split_in_order_and_merge_back_by_rows() -> None:
    kind = KIND_OF[Embed]
    request = Embed(id=1, texts=[f"t{i}" for i in range(10)])
    parts = kind.split(request, 4)
    assert [p.texts for p in parts] == [request.texts[0:4], request.texts[4:8],
                                        request.texts[8:10]]
    assert [kind.size(p) for p in parts] == [4, 4, 2]
    replies = [Embeddings(id=0, data=bytes([i]) * 2 * len(p.texts), shape=[len(p.texts), 2],
                          tokens=3 * len(p.texts)) for i, p in enumerate(parts)]
    merged = merge_rows(replies)
    assert merged.shape == [10, 2] and merged.data == b"".join(r.data for r in replies)
    assert merged.tokens == 30  # usage adds up over the parts


def test_only_repeatable_requests_are_deterministic() -> None:
    generate, image = KIND_OF[Generate], KIND_OF[GenerateImage]
    assert generate.deterministic(Generate(id=1, prompt="x", sampling=Sampling(temperature=0)))
    assert generate.deterministic(Generate(id=1, prompt="x",
                                           sampling=Sampling(temperature=1, seed=3)))
    assert not generate.deterministic(Generate(id=1, prompt="x",
                                               sampling=Sampling(temperature=1)))
    assert image.deterministic(GenerateImage(id=1, prompt="x", seed=1))
    assert not image.deterministic(GenerateImage(id=1, prompt="x"))
    assert KIND_OF[Embed].deterministic(Embed(id=1, texts=["a"]))


def test_images_are_found_and_replaced_through_the_row() -> None:
    kind = KIND_OF[Describe]
    request = Describe(id=1, image=ImageInput(data=b"png"))
    assert kind.images(request) == [ImageInput(data=b"png")]
    assert kind.with_images is not None
    assert kind.with_images(request, [ImageInput(url="u")]).image == ImageInput(url="u")
    assert KIND_OF[Embed].images(Embed(id=1, texts=["a"])) == []


def test_generate_needs_a_prompt_or_messages() -> None:
    check = KIND_OF[Generate].check
    assert check(Generate(id=1)) is not None
    assert check(Generate(id=1, prompt="hi")) is None


def test_unset_parameters_get_the_daemons_defaults_and_set_ones_stay() -> None:
    defaults = RequestDefaults(max_tokens=7, temperature=0.5, top_k=40, frequency_penalty=0.5,
                               steps=3, width=64)
    generate = with_defaults(Generate(id=1, prompt="x", sampling=Sampling(
        top_p=0.9, repetition_penalty=1.2)), defaults)
    assert generate.sampling == Sampling(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40,
                                         min_p=0.0, presence_penalty=0.0,
                                         frequency_penalty=0.5, repetition_penalty=1.2)
    image = with_defaults(GenerateImage(id=1, prompt="x", height=128), defaults)
    assert (image.steps, image.width, image.height, image.guidance) == (3, 64, 128, 7.5)
    embed = Embed(id=1, texts=["a"])
    assert with_defaults(embed, defaults) is embed  # nothing to fill: no copy


def test_build_makes_what_a_client_would_send_with_defaults_filled() -> None:
    request = kinds.build("generate", [{"role": "user", "content": "hi"}], max_tokens=3)
    assert isinstance(request, Generate)
    assert request.messages[0].content == "hi" and request.sampling.max_tokens == 3
    assert request.sampling.temperature == RequestDefaults().temperature


def test_defaults_are_validated_like_the_fields_they_fill() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"width": 100}, RequestDefaults)  # not a multiple of 8


def test_a_generation_takes_one_of_a_prompt_its_token_ids_or_messages() -> None:
    ids = kinds.build("generate", [5, 6, 7])
    assert isinstance(ids, Generate) and ids.prompt_ids == [5, 6, 7] and not ids.prompt
    check = KIND_OF[Generate].check
    assert check is not None and check(ids) is None
    for fields in ({}, {"prompt": "a", "prompt_ids": [1]},
                   {"prompt_ids": [1], "messages": [ChatMessage(role="user", content="a")]}):
        assert check(Generate(id=1, **fields)) == (
            "generate needs one of a prompt, prompt_ids or messages")


def test_a_description_takes_a_question_or_a_chat_its_image_in_a_users_message() -> None:
    check = KIND_OF[Describe].check
    assert check is not None
    chat = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="q")]
    image = ImageInput(data=b"png")
    assert check(Describe(id=1, image=image, messages=chat, image_at=1)) is None
    for fields in ({"image_at": 0}, {"image_at": 2},
                   {"image_at": 1, "more_images": [image], "more_at": [0]}):
        assert "an image goes with a user's message" in (
            check(Describe(id=1, image=image, messages=chat, **fields)) or "")
    assert check(Describe(id=1, image=image, prompt="q", messages=chat, image_at=1)) == (
        "describe takes a question or messages, not both")
    # Several images: each with its message (a question's: 0)
    assert check(Describe(id=1, image=image, messages=chat, image_at=1,
                          more_images=[image, image], more_at=[1, 1])) is None
    assert check(Describe(id=1, image=image, prompt="q", more_images=[image],
                          more_at=[0])) is None
    assert "place each of more_images" in (check(Describe(id=1, image=image, prompt="q",
                                                          more_images=[image])) or "")
    assert "past the end" in (check(Describe(id=1, image=image, prompt="q",
                                             image_offset=2)) or "")
    assert check(Describe(id=1, image=image, prompt="q", image_offset=1)) is None
    assert "a question is one message" in (check(Describe(
        id=1, image=image, prompt="q", more_images=[image], more_at=[1])) or "")
    both = kinds.build("describe", b"a", more_images=[b"b"], query=[{
        "role": m.role, "content": m.content} for m in chat])
    assert (both.image_at, both.more_at, len(both.more_images)) == (1, [1], 1)


def test_structured_output_asks_for_one_language_that_may_end() -> None:
    """A schema given as a dict travels as its JSON text; two languages, none, a schema
    that is not JSON, or ignore_eos (the language's end is the output's) are refused
    for generate and describe alike, before any worker sees them."""
    fields, _ = kinds.generate("hi", json_schema={"type": "object"})
    assert fields["sampling"].structured == Structured(json_schema='{"type":"object"}')
    assert kinds.generate("hi")[0]["sampling"].structured is None
    for op, args in (("generate", ("hi",)), ("describe", (b"\x89PNG",))):
        check = BY_OP[op].check

        def problem(op: str = op, args: tuple[Any, ...] = args, **asks: Any) -> str | None:
            return BY_OP[op].check(kinds.build(op, *args, **asks))

        assert problem(regex="a+") is None and problem(choice=["a"]) is None
        assert problem(json_schema="true") is None  # a JSON Schema may be true
        assert "not regex and choice" in (problem(regex="a", choice=["a"]) or "")
        assert "ignore_eos" in (problem(grammar='start: "a"', ignore_eos=True) or "")
        assert "JSON object" in (problem(json_schema="{not json") or "")
        assert "JSON object" in (problem(json_schema="[1]") or "")
        empty = msgspec.structs.replace(kinds.build(op, *args),
                                        sampling=Sampling(structured=Structured()))
        assert "not none" in (check(empty) or "")


def test_tools_go_to_the_chat_template_only() -> None:
    """Tools (or their JSON text) travel with a templated prompt or chat; with a raw
    prompt or token ids there is no template to show them, so they are refused."""
    tool = {"type": "function", "function": {"name": "f"}}
    check = BY_OP["generate"].check
    assert kinds.generate("hi", tools='[{"type": "function", "function": {"name": "f"}}]'
                          )[0]["tools"] == [tool]
    assert check(kinds.build("generate", "hi", tools=[tool])) is None
    for asks in ({"raw": True}, {}):
        prompt: Any = "hi" if asks else [1, 2]
        assert "chat template" in (check(kinds.build("generate", prompt, tools=[tool],
                                                     **asks)) or "")


def test_auto_tool_choice_needs_tools_and_a_chat_carries_calls_and_answers() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    check = BY_OP["generate"].check
    assert check(kinds.build("generate", "hi", tools=[tool], tool_choice="auto")) is None
    assert "it has none" in (check(kinds.build("generate", "hi", tool_choice="auto")) or "")
    call = ToolCall(name="f", arguments='{"a": 1}', id="c1")
    chat = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{}"}]},
            {"role": "tool", "content": "done", "tool_call_id": "c1"}]
    messages = kinds.build("generate", chat, tools=[tool]).messages
    assert messages[1] == ChatMessage(role="assistant", content="", tool_calls=[call])
    assert messages[2].tool_calls == [ToolCall(name="f", arguments="{}")]
    assert messages[3] == ChatMessage(role="tool", content="done", tool_call_id="c1")
    with pytest.raises(msgspec.ValidationError, match="arguments"):  # the client's BAD_REQUEST
        kinds.build("generate", [{"role": "assistant", "tool_calls": [{"name": "f"}]}])


def test_tokenize_reads_a_prompt_or_a_chat_as_generate_would() -> None:
    check = BY_OP["tokenize"].check
    tool = {"type": "function", "function": {"name": "f"}}
    chat = kinds.build("tokenize", [{"role": "user", "content": "hi"}], tools=[tool],
                       chat_template_kwargs='{"enable_thinking": false}', token_strs=True)
    assert isinstance(chat, Tokenize) and check(chat) is None
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.tools == [tool]
    assert check(kinds.build("tokenize", "hi", raw=True)) is None
    assert "one of them" in (check(kinds.build("tokenize", "")) or "")
    assert "not with raw" in (check(kinds.build("tokenize", "hi", raw=True, tools=[tool]))
                              or "")
    assert kinds.build("detokenize", ["1", 2]) == Detokenize(id=0, tokens=[1, 2])  # the CLI's
    assert BY_OP["tokenize"].served_by == ("text_to_text",)
