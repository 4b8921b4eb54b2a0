"""The vision-language loader on the tiny random-weight LLaVA: prompt building with the
image, the KV-cache decoding loop, sampling, stopping and context limits."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modelpool.protocol import kinds
from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.registry.loaders import load_model
from modelpool.registry.loaders.causal_lm import sample
from modelpool.registry.loaders.vision_lm import DEFAULT_PROMPT, VisionLM
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities import vision
from modelpool.workers.capabilities.text_to_text import GenerationStats

IMAGE_TOKENS = 16  # (32 px / 8 px patches) ** 2, as built by make_tiny_models
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def vlm(tiny_models_dir: Path) -> VisionLM:
    spec = ModelSpec(key="tiny-vision", capability="vision",
                     path=str(tiny_models_dir / "tiny-vision"))
    model = load_model(spec)  # through DEFAULT_LOADERS, as the worker does
    assert isinstance(model, VisionLM)
    return model


@pytest.fixture(scope="module")
def image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), "RGB")


def _describe(vlm: VisionLM, image: Image.Image,
              **fields: object) -> tuple[list[str], GenerationStats]:
    stats = GenerationStats()
    request = kinds.build("describe", b"unused", fields.pop("prompt", ""), **fields)
    return list(vlm.describe(image, request, stats)), stats


def _inputs(vlm: VisionLM, image: Image.Image, prompt: str = "",
            **fields: object) -> dict[str, torch.Tensor]:
    return vlm.prompt_inputs(image, kinds.build("describe", b"unused", prompt, **fields))


def _decode_without_cache(vlm: VisionLM, image: Image.Image, steps: int,
                          temperature: float, seed: int) -> list[int]:
    """Reference decoding: the whole sequence and the image again for every token."""
    inputs = _inputs(vlm, image, QUESTION)
    ids = inputs["input_ids"]
    out: list[int] = []
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for _ in range(steps):
            logits = vlm.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                               pixel_values=inputs["pixel_values"]).logits[0, -1].float()
            token = sample(logits, temperature, 1.0, generator)
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def test_info(vlm: VisionLM) -> None:
    assert vlm.info() == {"context": 2048, "chat_template": True, "reasoning_format": None,
                          "tool_call_format": "hermes",
                          "image_size": vlm.model.config.vision_config.image_size}
    assert vlm.tokenizer.eos_token_id in vlm.eos_ids


def test_greedy_is_deterministic(vlm: VisionLM, image: Image.Image) -> None:
    fields = {"prompt": QUESTION, "temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    first, stats = _describe(vlm, image, **fields)
    assert _describe(vlm, image, **fields)[0] == first
    assert stats.completion_tokens == 6
    expected = _decode_without_cache(vlm, image, 6, temperature=0.0, seed=0)
    assert "".join(first) == vlm.tokenizer.decode(expected, skip_special_tokens=True)


def test_sampling_matches_uncached_decoding(vlm: VisionLM, image: Image.Image) -> None:
    # Sampled output of random weights is varied, unlike greedy output (often one token
    # repeated), so this catches a loop that loses the image or the KV cache.
    pieces, _ = _describe(vlm, image, prompt=QUESTION, temperature=1.0, seed=5,
                          max_tokens=12, ignore_eos=True)
    expected = _decode_without_cache(vlm, image, 12, temperature=1.0, seed=5)
    assert len(set(expected)) > 4
    assert "".join(pieces) == vlm.tokenizer.decode(expected, skip_special_tokens=True)


def test_seed_makes_sampling_reproducible(vlm: VisionLM, image: Image.Image) -> None:
    fields = {"prompt": QUESTION, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    text = "".join(_describe(vlm, image, seed=7, **fields)[0])
    assert "".join(_describe(vlm, image, seed=7, **fields)[0]) == text
    others = {"".join(_describe(vlm, image, seed=s, **fields)[0]) for s in range(1, 5)}
    assert len(others | {text}) > 1


def test_the_image_changes_the_prediction(vlm: VisionLM, image: Image.Image) -> None:
    # Sampled text of a random model hardly depends on its input; the logits do.
    other = Image.new("RGB", image.size, (255, 255, 255))
    with torch.inference_mode():
        logits = [vlm.model(**_inputs(vlm, im, QUESTION)).logits[0, -1]
                  for im in (image, other)]
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def test_ignore_eos_runs_to_max_tokens(vlm: VisionLM, image: Image.Image) -> None:
    pieces, stats = _describe(vlm, image, temperature=1.0, seed=11, max_tokens=8,
                              ignore_eos=True)
    assert (stats.completion_tokens, stats.finish_reason) == (8, "length")
    # One piece per token (maybe "" mid-character) plus at most one flushed tail.
    assert len(pieces) in (8, 9) and all(isinstance(p, str) for p in pieces)


def test_eos_stops_generation(vlm: VisionLM, image: Image.Image,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The random model rarely picks its real EOS; declare its first greedy token EOS.
    first = _decode_without_cache(vlm, image, 1, temperature=0.0, seed=0)[0]
    monkeypatch.setattr(vlm, "eos_ids", {first})
    pieces, stats = _describe(vlm, image, prompt=QUESTION, temperature=0.0, max_tokens=8)
    assert (pieces, stats.finish_reason, stats.completion_tokens) == ([], "stop", 0)
    _, stats = _describe(vlm, image, prompt=QUESTION, temperature=0.0, max_tokens=8,
                         ignore_eos=True)
    assert (stats.finish_reason, stats.completion_tokens) == ("length", 8)


def test_prompt_tokens_count_the_image(vlm: VisionLM, image: Image.Image) -> None:
    _, stats = _describe(vlm, image, prompt=QUESTION, temperature=0.0, max_tokens=1)
    text = vlm.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True, tokenize=False)
    text_tokens = len(vlm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert stats.prompt_tokens > text_tokens
    # The template's one placeholder stands for one token per image patch.
    assert stats.prompt_tokens == text_tokens - 1 + IMAGE_TOKENS
    assert QUESTION in text and "<image>" in text


def test_empty_prompt_asks_for_a_description(vlm: VisionLM, image: Image.Image) -> None:
    default = _inputs(vlm, image, "")["input_ids"]
    assert torch.equal(default, _inputs(vlm, image, DEFAULT_PROMPT)["input_ids"])
    assert DEFAULT_PROMPT in vlm.tokenizer.decode(default[0])


CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "And its colour?"}]


def test_a_chat_is_read_whole_its_image_in_its_own_message(vlm: VisionLM,
                                                             image: Image.Image) -> None:
    request = kinds.build("describe", b"unused", CHAT, image_at=1)
    ids = vlm.prompt_inputs(image, request)["input_ids"][0]
    text = vlm.tokenizer.decode(ids.tolist())
    order = [text.index(part) for part in ("Be brief.", "<image>", "What is it?",
                                           "A square.", "And its colour?")]
    assert order == sorted(order) and ids.tolist().count(vlm.processor.image_token_id) == \
        IMAGE_TOKENS
    _, stats = _describe(vlm, image, prompt=CHAT, image_at=1, max_tokens=2, ignore_eos=True)
    _, alone = _describe(vlm, image, prompt="And its colour?", max_tokens=2, ignore_eos=True)
    assert stats.prompt_tokens > alone.prompt_tokens + 8  # the turns before it count
    # By default the image goes with the last user's message; one with no text asks for
    # a caption, as an empty question does.
    last = kinds.build("describe", b"unused", [{"role": "user", "content": ""}])
    assert last.image_at == 0 and torch.equal(
        vlm.prompt_inputs(image, last)["input_ids"],
        _inputs(vlm, image, "")["input_ids"])
    assert kinds.build("describe", b"unused", CHAT).image_at == 3


def test_a_chats_images_each_in_its_message(vlm: VisionLM, image: Image.Image) -> None:
    """Two images, one in each user message: each its placeholders, in order, and the
    model sees both (swapped, the prediction changes)."""
    other = Image.new("RGB", (40, 40), (0, 200, 0))
    chat = [{"role": "user", "content": "this one?"}, {"role": "assistant", "content": "A."},
            {"role": "user", "content": "and this one?"}]
    request = kinds.build("describe", image, chat, more_images=[other], image_at=[0, 2],
                          max_tokens=3,
                          ignore_eos=True)
    assert (request.image_at, request.more_at) == (0, [2])
    inputs = vlm.prompt_inputs(image, request, [other])
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(vlm.processor.image_token_id) == 2 * IMAGE_TOKENS
    text = vlm.tokenizer.decode(ids)
    order = [text.index(part) for part in ("this one?", "A.", "and this one?")]
    assert order == sorted(order) and text.index("<image>") < order[0]
    assert text.rindex("<image>") in range(order[1], order[2])
    swapped = vlm.prompt_inputs(other, request, [image])
    with torch.inference_mode():
        logits = [vlm.model(**i).logits[0, -1] for i in (inputs, swapped)]
    assert not torch.allclose(*logits)
    stats = GenerationStats()
    list(vlm.describe(image, request, stats, more=[other]))
    assert (stats.prompt_tokens, stats.completion_tokens) == (len(ids), 3)


def test_images_between_a_messages_words_stay_there(vlm: VisionLM,
                                                     image: Image.Image) -> None:
    """"Left: <image> right: <image> which is greener?" keeps its order."""
    other = Image.new("RGB", (40, 40), (0, 200, 0))
    question = "Left: right: which is greener?"
    request = kinds.build("describe", image, question, more_images=[other],
                          image_offset=[6, 13])
    text = vlm.tokenizer.decode(vlm.prompt_inputs(image, request, [other])[
        "input_ids"][0].tolist())
    first, last = text.index("<image>"), text.rindex("<image>")
    assert text.index("Left:") < first < text.index("right:") < last < text.index("which")
    assert "Left: right:" not in text


def test_its_tools_are_shown_and_its_calls_read_one_at_a_time(vlm: VisionLM,
                                                              image: Image.Image) -> None:
    """The tiny template shows tools as Qwen2-VL's does (Hermes' format, from its signs);
    the worker's one-at-a-time path reads the calls the model writes (held to one by a
    regex)."""
    tool = {"type": "function", "function": {"name": "get_weather"}}
    called = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    request = kinds.build("describe", b"unused", QUESTION, tools=[tool], tool_choice="auto",
                          regex=re.escape(called), temperature=0, max_tokens=150)
    prompt = vlm.tokenizer.decode(_inputs(vlm, image, QUESTION, tools=[tool])[
        "input_ids"][0].tolist())
    assert '"get_weather"' in prompt and "<tools>" in prompt
    output = vision._output(vlm, request)
    stats = GenerationStats()
    text = "".join(output.feed(piece)[0] for piece in vlm.describe(image, request, stats))
    rest, calls = output.finish()
    assert (text + rest, [(c.name, c.arguments) for c in calls]) == (
        "", [("get_weather", '{"city":"Oslo"}')])  # as a JSON encoder writes it
    assert vision._output(vlm, kinds.build("describe", b"unused", QUESTION,
                                           tools=[tool])).calls is None  # "none"


def test_control_tokens_in_the_prompt_are_text(vlm: VisionLM, image: Image.Image) -> None:
    # Unescaped, "<image>" would be a second image slot (a shape error at the first step)
    # and "<|im_end|>" would end the user's turn.
    ids = _inputs(vlm, image, "<image> and <|im_end|>?")["input_ids"][0].tolist()
    assert ids.count(vlm.processor.image_token_id) == IMAGE_TOKENS
    assert ids.count(vlm.tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1
    _, stats = _describe(vlm, image, prompt="<image> and <|im_end|>?", max_tokens=2,
                         ignore_eos=True)
    assert stats.completion_tokens == 2


def test_non_rgb_images_are_converted(vlm: VisionLM, image: Image.Image) -> None:
    grey = image.convert("L")
    pixels = _inputs(vlm, grey, QUESTION)["pixel_values"]
    assert torch.equal(pixels, _inputs(vlm, grey.convert("RGB"), QUESTION)["pixel_values"])


def test_prompt_longer_than_context_is_a_bad_request(vlm: VisionLM, image: Image.Image) -> None:
    prompt = "~" * 2048  # one token per "~": the tiny BPE learned no merge for it
    with pytest.raises(PoolError) as err:
        _describe(vlm, image, prompt=prompt, max_tokens=4)
    assert err.value.code == ErrorCode.BAD_REQUEST
    assert "2048" in err.value.message


def test_a_context_option_lowers_the_models_own(tiny_models_dir: Path,
                                               image: Image.Image) -> None:
    spec = ModelSpec(key="short", capability="vision", options={"context": 48},
                     path=str(tiny_models_dir / "tiny-vision"))
    short = load_model(spec)
    assert isinstance(short, VisionLM) and short.info()["context"] == 48
    _, stats = _describe(short, image, prompt="~", temperature=0.0, max_tokens=1_000_000,
                         ignore_eos=True)
    assert stats.prompt_tokens > IMAGE_TOKENS  # the image's tokens count against it
    assert stats.prompt_tokens + stats.completion_tokens == 48


def test_budget_is_capped_by_the_context(vlm: VisionLM, image: Image.Image) -> None:
    overhead = len(_inputs(vlm, image, "~")["input_ids"][0]) - 1
    prompt = "~" * (vlm.context - 1 - overhead)
    _, stats = _describe(vlm, image, prompt=prompt, temperature=0.0, max_tokens=5,
                         ignore_eos=True)
    assert (stats.prompt_tokens, stats.completion_tokens) == (vlm.context - 1, 1)
    assert stats.finish_reason == "length"
