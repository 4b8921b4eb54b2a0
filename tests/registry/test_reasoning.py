"""A reasoning model's thinking read out of its text (`<think>`), as it streams, and
which models reason."""

from __future__ import annotations

import re
from typing import Any

import pytest

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Chunk, End
from modelpool.protocol.pipes import WorkItem
from modelpool.registry.loaders.reasoning import FORMATS, ReasoningReader, thinking_tags
from modelpool.workers.capabilities import text_to_text
from modelpool.workers.streams import StreamLoop


def _split(text: str, piece: int, inside: bool = False) -> tuple[str, str]:
    """(thinking, answer) as read from `text` fed `piece` characters at a time."""
    reader = ReasoningReader(inside)
    read = [reader.feed(text[i:i + piece]) for i in range(0, len(text), piece)]
    read.append(reader.finish())
    return "".join(t for t, _ in read), "".join(a for _, a in read)


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 1000])
def test_thinking_and_answer_are_apart_whatever_the_pieces(piece: int) -> None:
    text = "<think>\nThe user greets me. <thin is not a tag.\n</think>\n\nHello there!"
    assert _split(text, piece) == ("The user greets me. <thin is not a tag.", "Hello there!")
    # a template that opened the thinking: only its close comes
    assert _split("Short one.</think>\n\nHi", piece, inside=True) == ("Short one.", "Hi")
    # no thinking: the answer as it is, its leading space kept
    assert _split("  Hi <think> there", piece) == ("", "  Hi <think> there")
    assert _split("<thinking>x", piece) == ("", "<thinking>x")


def test_an_answer_passes_on_as_it_comes_and_a_tag_in_pieces_is_held() -> None:
    reader = ReasoningReader(False)
    assert reader.feed("<th") == ("", "")  # may open the thinking
    assert reader.feed("ink>Let me") == ("Let me", "")
    assert reader.feed(" see </th") == (" see", "")  # the tag may be closing
    assert reader.feed("ink>\n") == ("", "")
    assert reader.feed("\nOK") == ("", "OK")
    assert reader.feed(", done") == ("", ", done")
    assert reader.finish() == ("", "")


def test_an_output_cut_short_inside_the_thinking_is_all_thinking() -> None:
    assert _split("<think>Still going </th", 4) == ("Still going </th", "")
    assert _split("<think>\n\n</think>\n\n", 1) == ("", "")  # thought nothing, said nothing
    assert _split("  <thi", 2) == ("", "  <thi")  # the answer's start, not a tag


def test_a_model_reasons_by_its_option_else_by_its_template() -> None:
    qwen3 = "{%- if '</think>' in content %}{{ content.split('</think>')[-1] }}{% endif %}"
    assert thinking_tags(qwen3, None, "m") is FORMATS["think"]
    assert thinking_tags("{{ messages }}", None, "m") is None
    assert thinking_tags("{{ '[THINK]' + t + '[/THINK]' }}", None, "m") is FORMATS["mistral"]
    assert thinking_tags("<seed:think>{{ t }}</seed:think>", None, "m") is FORMATS["seed_oss"]
    assert thinking_tags("{{ messages }}", "think", "m") is FORMATS["think"]
    for vllms in ("deepseek_r1", "qwen3", "glm45", "minimax_m2"):  # its parsers' names
        assert thinking_tags("{{ messages }}", vllms, "m") is FORMATS["think"]
    assert thinking_tags(GRANITE_SYSTEM, None, "m") is FORMATS["granite"]
    assert thinking_tags(qwen3, "none", "m") is None
    with pytest.raises(ValueError, match="reasoning_format 'r1' is not one of"):
        thinking_tags(qwen3, "r1", "m")


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_other_tags_are_read_alike(piece: int) -> None:
    for tags, text in ((FORMATS["mistral"], "[THINK]Hmm [/THI, no.[/THINK]\nYes."),
                       (FORMATS["seed_oss"], "<seed:think>Hmm</think>.</seed:think>Yes.")):
        reader = ReasoningReader(False, tags)
        read = [reader.feed(text[i:i + piece]) for i in range(0, len(text), piece)]
        read.append(reader.finish())
        thinking, answer = "".join(t for t, _ in read), "".join(a for _, a in read)
        assert (thinking, answer) == (text[len(tags.opens):text.index(tags.closes)], "Yes.")


# Granite 3.2's system prompt with its `thinking` variable on
GRANITE_SYSTEM = ("{%- if thinking %}... Write your thoughts after 'Here is my thought "
                  "process:' and write your response after 'Here is my response:' for each "
                  "user query.{%- endif %}")


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_granites_prose_markers_either_way_it_writes_them(piece: int) -> None:
    """Granite 3.2 writes "Here is" or "Here's" (vLLM's parser reads both); text that only
    begins like a marker is the answer's."""
    reader = ReasoningReader(False, FORMATS["granite"])
    text = ("Here's my thought process:\nHere is my plan: add.\n\nHere is my response:\n"
            "2 + 2 = 4.")
    read = [reader.feed(text[i:i + piece]) for i in range(0, len(text), piece)]
    read.append(reader.finish())
    assert ("".join(t for t, _ in read), "".join(a for _, a in read)) == (
        "Here is my plan: add.", "2 + 2 = 4.")
    plain = ReasoningReader(False, FORMATS["granite"])
    assert plain.feed("Here is the answer.") == ("", "Here is the answer.")
    for way in ("Here is", "Here's"):
        reader = ReasoningReader(False, FORMATS["granite"])
        assert reader.feed(f"{way} my thought process: a") == ("a", "") and reader.thinking


# Qwen3's switch: its generation prompt opens the thinking, or writes an empty one
QWEN3_PROMPT = ("<|im_start|>assistant\n{% if enable_thinking is defined and "
                "enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
                "{% endif %}")


def test_each_prompt_says_whether_the_output_starts_inside_the_thinking(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that opens the thinking (Qwen3's, unless a request's
    chat_template_kwargs turn it off) has the output start inside it."""
    template = llm.tokenizer.chat_template
    assert template.count("<|im_start|>assistant\n{% endif") == 1
    monkeypatch.setattr(llm, "thinking", FORMATS["think"])
    chat = [{"role": "user", "content": "hi"}]
    assert llm.reasoning_reader(kinds.build("generate", chat)).state == "start"
    monkeypatch.setattr(llm.tokenizer, "chat_template", template.replace(
        "<|im_start|>assistant\n{% endif", QWEN3_PROMPT + "{% endif"))
    assert llm.reasoning_reader(kinds.build("generate", chat)).state == "inside"
    off = kinds.build("generate", chat, chat_template_kwargs={"enable_thinking": False})
    assert llm.tokenizer.decode(llm.prompt_ids(off)).endswith("<think>\n\n</think>\n\n")
    assert llm.reasoning_reader(off).state == "start"
    # held to a language, the output thinks first all the same (the language holds the
    # answer: test_thinking_first.py), unless the language holds the thinking too
    assert llm.reasoning_reader(kinds.build("generate", chat, regex="a")).state == "inside"
    monkeypatch.setattr(llm, "structured_in_reasoning", True)
    assert llm.reasoning_reader(kinds.build("generate", chat, regex="a")).state == "start"


def test_reasoning_effort_goes_to_a_template_that_reads_it_and_others_refuse_it(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    chat = [{"role": "user", "content": "hi"}]
    high = kinds.build("generate", chat, reasoning_effort="high")
    with pytest.raises(PoolError, match="reasoning_effort: model 'tiny-llm'"):
        llm.prompt_ids(high)
    monkeypatch.setattr(llm.tokenizer, "chat_template", llm.tokenizer.chat_template +
                        "{% if reasoning_effort is defined %}Effort: {{ reasoning_effort }}"
                        "{% endif %}")
    assert llm.tokenizer.decode(llm.prompt_ids(high)).endswith("Effort: high")
    assert "Effort" not in llm.tokenizer.decode(llm.prompt_ids(kinds.build("generate", chat)))


@pytest.mark.parametrize("name", ["chat_template", "messages", "add_generation_prompt",
                                  "bos_token", "tokenize"])
def test_a_requests_template_variables_may_not_stand_for_the_daemons(llm: Any,
                                                                      name: str) -> None:
    request = kinds.build("generate", [{"role": "user", "content": "hi"}],
                          chat_template_kwargs={name: "{{ 1 }}"})
    with pytest.raises(PoolError) as refused:
        llm.prompt_ids(request)
    assert refused.value.code is ErrorCode.BAD_REQUEST
    assert refused.value.message.startswith(f"chat_template_kwargs: {name!r}")


class Outbox:
    """What a worker's adapters and its stream loop send to, recorded."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.image_bytes: dict[int, bytes] = {}

    def take_images(self, items: list[WorkItem]) -> None:
        pass

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def tick(self, tokens: int = 0) -> None:
        pass

    def aborted(self, job_id: int) -> bool:
        return False


WRITTEN = "<think>\nThe user asks for a city.\n</think>\n\nParis."


def _chat(**options: Any) -> Any:
    return kinds.build("generate", [{"role": "user", "content": "a city?"}],
                       regex=re.escape(WRITTEN), temperature=0, **options)


def test_the_tiny_model_held_to_thinking_then_an_answer_has_them_apart(
        llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-llm, taken as a reasoning model, held by a regex to a thought and an answer
    (structured_in_reasoning: the language holds the thinking too): its chunks carry
    them apart, one request at a time."""
    monkeypatch.setattr(llm, "thinking", FORMATS["think"])
    monkeypatch.setattr(llm, "structured_in_reasoning", True)
    out = Outbox()
    text_to_text.run(llm, [WorkItem(job_id=1, request=_chat())], out, 1)
    chunks = [m for m in out.sent if isinstance(m, Chunk)]
    assert "".join(c.reasoning for c in chunks) == "The user asks for a city."
    assert "".join(c.text for c in chunks) == "Paris."
    assert isinstance(out.sent[-1], End) and out.sent[-1].finish_reason == "stop"
    # a template that opens the thinking: held to a language, the output opens it itself
    monkeypatch.setattr(llm.tokenizer, "chat_template", llm.tokenizer.chat_template.replace(
        "<|im_start|>assistant\n{% endif", QWEN3_PROMPT + "{% endif"))
    out = Outbox()
    text_to_text.run(llm, [WorkItem(job_id=5, request=_chat())], out, 1)
    assert "".join(m.reasoning for m in out.sent if isinstance(m, Chunk)) == (
        "The user asks for a city.")
    # a raw prompt's text is the client's to read: all of it is text
    out = Outbox()
    raw = kinds.build("generate", "a city?", raw=True, regex=re.escape(WRITTEN),
                      temperature=0)
    text_to_text.run(llm, [WorkItem(job_id=2, request=raw)], out, 1)
    assert "".join(m.text for m in out.sent if isinstance(m, Chunk)) == WRITTEN
    # a model that does not reason: text too
    monkeypatch.setattr(llm, "thinking", None)
    out = Outbox()
    text_to_text.run(llm, [WorkItem(job_id=3, request=_chat())], out, 1)
    assert "".join(m.text for m in out.sent if isinstance(m, Chunk)) == WRITTEN


def test_continuous_batching_reads_the_thinking_too(llm: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm, "thinking", FORMATS["think"])
    monkeypatch.setattr(llm, "structured_in_reasoning", True)
    out = Outbox()
    loop = StreamLoop(llm.decoder(), lambda item: text_to_text.prepare(llm, item, out), out)
    loop._start([WorkItem(job_id=4, request=_chat())])
    while loop.streams:
        loop._step()
    chunks = [m for m in out.sent if isinstance(m, Chunk)]
    assert "".join(c.reasoning for c in chunks) == "The user asks for a city."
    assert "".join(c.text for c in chunks) == "Paris."
