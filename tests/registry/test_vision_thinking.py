"""A vision model that reasons (Qwen3-VL's thinking models, GLM-4.1V-Thinking, ...): its
thinking read apart from its answer, as a causal LM's is, one request at a time and
continuously batched. tiny-vision plays one: a copy whose template opens `<think>`
unless `enable_thinking` is false, as Qwen3's does."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from test_reasoning import Outbox

from modelpool.protocol import kinds
from modelpool.protocol.errors import PoolError
from modelpool.protocol.messages import Chunk, End
from modelpool.protocol.pipes import WorkItem
from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.grammar import AfterThinking
from modelpool.registry.loaders.vision_lm import VisionLM
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats, TextOutput, stream_text
from modelpool.workers.streams import StreamLoop

PROMPT = "'<|im_start|>assistant\\n'"  # in the template, a Jinja string


@pytest.fixture(scope="module")
def thinking_vlm(tiny_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> VisionLM:
    model_dir = tmp_path_factory.mktemp("vision-thinker") / "tiny-vision"
    shutil.copytree(tiny_models_dir / "tiny-vision", model_dir)
    template = model_dir / "chat_template.jinja"
    assert template.read_text().count(PROMPT) == 1
    template.write_text(template.read_text().replace(PROMPT, PROMPT + (
        " + ('<think>\\n' if enable_thinking is not defined or enable_thinking else '')")))
    model = load_model(ModelSpec(key="tiny-vision", capability="vision", path=str(model_dir),
                                 options={"reasoning_format": "think"}))
    assert isinstance(model, VisionLM) and model.info()["reasoning_format"] == "think"
    return model


@pytest.fixture(scope="module")
def image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), "RGB")


def _parts(out: Outbox) -> tuple[str, str, End]:
    chunks = [m for m in out.sent if isinstance(m, Chunk)]
    assert isinstance(out.sent[-1], End)
    return "".join(c.reasoning for c in chunks), "".join(c.text for c in chunks), out.sent[-1]


def _alone(vlm: VisionLM, image: Image.Image, request: Any) -> tuple[str, str, End]:
    out, stats = Outbox(), GenerationStats()
    output = TextOutput(request.sampling, None, vlm.reasoning_reader(request))
    stream_text(1, lambda: vlm.describe(image, request, stats), stats, output, out)
    return _parts(out)


def _batched(vlm: VisionLM, image: Image.Image, request: Any) -> tuple[str, str, End]:
    out = Outbox()
    loop = StreamLoop(vlm.decoder(), lambda item: vlm.prepare(image, item.request), out)
    loop._start([WorkItem(job_id=2, request=request)])
    while loop.streams:
        loop._step()
    return _parts(out)


def test_its_template_opened_the_thinking_so_a_cut_answer_is_all_thinking(
        thinking_vlm: VisionLM, image: Image.Image) -> None:
    request = kinds.build("describe", b"unused", "what is it?", max_tokens=8,
                          temperature=1.0, seed=2)
    thought, answer, end = _alone(thinking_vlm, image, request)
    assert thought and answer == "" and end.finish_reason == "length"
    assert end.reasoning_tokens == end.completion_tokens == 8
    assert _batched(thinking_vlm, image, request)[:2] == (thought, "")
    # held to a language, it thinks first: the language waits for the closing tag
    held = kinds.build("describe", b"unused", "what is it?", regex="A cat[.]")
    assert isinstance(thinking_vlm.language(held), AfterThinking)


def test_held_whole_to_a_thought_and_an_answer_it_has_them_apart(
        thinking_vlm: VisionLM, image: Image.Image, monkeypatch: pytest.MonkeyPatch) -> None:
    """structured_in_reasoning: the regex holds the whole output, which opens the tag
    itself (the template's is in the prompt)."""
    monkeypatch.setattr(thinking_vlm, "structured_in_reasoning", True)
    written = "<think>\nStripes of colour.\n</think>\n\nA test card."
    request = kinds.build("describe", b"unused", "what is it?", regex=re.escape(written),
                          temperature=0)
    for run in (_alone, _batched):
        thought, answer, end = run(thinking_vlm, image, request)
        assert (thought, answer, end.finish_reason) == ("Stripes of colour.", "A test card.",
                                                        "stop")
        assert 0 < end.reasoning_tokens < end.completion_tokens


def test_a_questions_template_is_read_once_for_its_reader_and_its_language(
        thinking_vlm: VisionLM, image: Image.Image, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the generation prompt opened the thinking is read from one rendering of
    the template, asked by the reader and by a structured output's gate alike."""
    rendered = []
    render = thinking_vlm.processor.apply_chat_template
    monkeypatch.setattr(thinking_vlm.processor, "apply_chat_template", lambda *a, **k: (
        rendered.append(k.get("tokenize")) or render(*a, **k)))
    held = kinds.build("describe", b"unused", "what colour?", regex="A cat[.]")
    prepared = thinking_vlm.prepare(image, held)
    assert isinstance(prepared.grammar, AfterThinking) and prepared.reasoning is not None
    assert rendered.count(False) == 1  # the text for both; the inputs tokenized apart


def test_its_template_takes_the_requests_variables(thinking_vlm: VisionLM,
                                                     image: Image.Image) -> None:
    """chat_template_kwargs reach the processor's template (the thinking switched off, so
    the output starts as the answer); what the daemon sets, or a reasoning_effort the
    template does not read, is refused by name."""
    asked = {"max_tokens": 3, "temperature": 0.0}
    off = kinds.build("describe", b"unused", "q?", chat_template_kwargs={
        "enable_thinking": False}, **asked)
    on = kinds.build("describe", b"unused", "q?", **asked)
    prompts = [thinking_vlm.tokenizer.decode(thinking_vlm.prompt_inputs(image, r)[
        "input_ids"][0].tolist()) for r in (off, on)]
    assert [p.endswith("<think>\n") for p in prompts] == [False, True]
    readers = [thinking_vlm.reasoning_reader(r) for r in (off, on)]
    assert [r.thinking for r in readers if r is not None] == [False, True]
    for fields, says in (({"chat_template_kwargs": {"tools": []}}, "'tools' is set by"),
                         ({"chat_template_kwargs": {"bos_token": "x"}}, "'bos_token' is set"),
                         ({"reasoning_effort": "high"}, "takes none")):
        with pytest.raises(PoolError, match=says):
            thinking_vlm.prompt_inputs(image, kinds.build("describe", b"unused", "q?",
                                                          **fields))
