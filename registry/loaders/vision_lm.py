"""Vision-language models (image + text in, text out: LLaVA and kin) with transformers.

The image and question go through the processor's chat template; decoding then runs token
by token with a KV cache, the image encoded once on the first step, and samples exactly as
the causal LMs do, so the worker can stream, count progress and stop between tokens."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from jinja2.exceptions import TemplateError
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import ChatMessage, Describe, encoder
from modelpool.registry.loaders import batch_fit
from modelpool.registry.loaders.batched_decode import ContinuousDecoder, Prepared
from modelpool.registry.loaders.causal_lm import decode, eos_ids_of
from modelpool.registry.loaders.chat_prompt import template_message, template_variables
from modelpool.registry.loaders.common import (
    configured_tokens,
    own_tokens,
    place,
    pretrained_kwargs,
    require_dir,
    vocab_size,
)
from modelpool.registry.loaders.grammar import AfterThinking, GrammarMatcher, Grammars
from modelpool.registry.loaders.logit_rules import check_logit_bias
from modelpool.registry.loaders.reasoning import (
    ReasoningReader,
    ThinkingTags,
    one_token,
    opens_thinking,
    structured_in_reasoning,
    thinking_tags,
)
from modelpool.registry.loaders.token_logprobs import check_prompt_logprobs
from modelpool.registry.loaders.tool_calls import (
    ToolCallReader,
    ToolFormat,
    auto_reader,
    format_of,
    kept_tokens,
)
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats

DEFAULT_PROMPT = "Describe this image."


class VisionLM:
    reads_many_images = True  # a chat's images, each in its message

    def __init__(self, key: str, processor: Any, model: Any, context: int,
                 thinking: ThinkingTags | None = None,
                 structured_in_reasoning: bool = False,
                 tool_format: ToolFormat | None = None) -> None:
        self.key = key
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.model = model.eval()
        self.context = context  # prompt (image tokens too) and output tokens together
        self.eos_ids = (eos_ids_of(model, self.tokenizer)
                        | _config_eos(model.config.get_text_config()))
        self.vocab = vocab_size(model)
        self.grammars = Grammars(self.tokenizer, self.vocab, self.eos_ids)
        self.template = str(getattr(processor, "chat_template", None) or "")
        # a reasoning model's thinking and its tool calls, read as a causal LM's are
        # (causal_lm.py)
        self.thinking = thinking if self.template else None
        self.structured_in_reasoning = structured_in_reasoning
        self.reasoning_markers = kept_tokens(self.tokenizer, (
            self.thinking.opens, self.thinking.closes) if self.thinking else ())
        self.tool_format = tool_format if self.template else None
        self.tool_markers = kept_tokens(self.tokenizer, tool_format.markers
                                        if self.tool_format else ())
        self.open_token = one_token(self.tokenizer, self.thinking.opens) if self.thinking else None
        self._last_opened: tuple[tuple[str, int, bytes], bool] | None = None

    def reasoning_reader(self, request: Describe) -> ReasoningReader | None:
        """What reads the thinking out of the output, for a model that reasons: inside
        it from the start when the template's generation prompt opened it."""
        if self.thinking is None:
            return None
        if request.sampling.structured is not None and self.structured_in_reasoning:
            return ReasoningReader(False, self.thinking)
        return ReasoningReader(self._opened(request), self.thinking)

    def tool_reader(self, request: Describe) -> ToolCallReader | None:
        """What reads the calls out of the output (tool_choice "auto"), else None."""
        return auto_reader(self.tool_format, self.key, request)

    def _kept(self, request: Describe) -> dict[int, str] | None:
        """The special tokens its text keeps: the thinking's tags, and the tool-call
        format's markers when it may call."""
        kept = {**self.reasoning_markers,
                **(self.tool_markers if request.tool_choice == "auto" else {})}
        return kept or None

    def _opened(self, request: Describe) -> bool:
        """Whether the template's generation prompt opens the thinking for this question
        (the last question's answer kept: the reader and the language both ask)."""
        assert self.thinking is not None
        asked = (request.prompt, request.image_at, encoder.encode([
            request.messages, request.more_at, request.image_offset, request.more_offsets,
            request.tools, request.chat_template_kwargs, request.reasoning_effort]))
        if self._last_opened is None or self._last_opened[0] != asked:
            slots = [{"type": "image"}] * (1 + len(request.more_at))
            rendered = self._rendered(request, slots, tokenize=False)
            self._last_opened = (asked, opens_thinking(str(rendered), self.thinking))
        return self._last_opened[1]

    def language(self, request: Describe) -> GrammarMatcher | None:
        """What holds the output to the request's language: after the thinking, for a
        model that reasons (causal_lm.CausalLM.language)."""
        grammar = self.grammars.matcher(request.sampling.structured)
        if grammar is None or self.thinking is None or self.structured_in_reasoning:
            return grammar
        return AfterThinking(grammar, self.thinking.closings, self.tokenizer,
                             self._opened(request), self.open_token)

    def info(self) -> dict[str, Any]:
        vision = getattr(self.model.config, "vision_config", None)
        return {"context": self.context, "image_size": getattr(vision, "image_size", None),
                "chat_template": bool(self.template),
                "reasoning_format": self.thinking.name if self.thinking else None,
                "tool_call_format": self.tool_format.name if self.tool_format else None}

    def _rendered(self, request: Describe, images: list[dict[str, Any]], **how: Any) -> Any:
        """The request's chat through the processor's template, with its tools and
        variables; one it refuses (roles that must alternate, ...) is the client's error.
        OpenAI's `developer` is the `system` of a template that does not know it."""
        messages = request.messages
        if "developer" not in self.template:
            messages = [msgspec.structs.replace(m, role="system") if m.role == "developer"
                        else m for m in messages]
        variables = template_variables(self.processor, self.template, self.key,
                                       request.chat_template_kwargs, request.reasoning_effort)
        try:
            return self.processor.apply_chat_template(
                vision_chat(request.prompt, messages, list(zip(
                    [request.image_at, *request.more_at],
                    [request.image_offset, *(request.more_offsets or [0] * len(request.more_at))],
                    images, strict=True))),
                tools=request.tools or None, add_generation_prompt=True, **how, **variables)
        except TemplateError as exc:
            raise PoolError(ErrorCode.BAD_REQUEST, f"model {self.key!r}'s chat template "
                            f"refused the messages: {exc}") from None

    def prompt_inputs(self, image: Image.Image, request: Describe,
                      more: Sequence[Image.Image] = ()) -> dict[str, torch.Tensor]:
        """input_ids (image placeholders expanded), attention_mask, pixel_values, ...,
        for its question or its chat (the image in message `image_at`, the `more` images
        in theirs)."""
        rgb = [i if i.mode == "RGB" else i.convert("RGB") for i in (image, *more)]
        if self.template:
            # sanitize_control_tokens: a question containing "<image>" or "<|im_end|>" is
            # text, not a second image slot (a shape error) or a forged turn.
            inputs = self._rendered(request, [{"type": "image", "image": i} for i in rgb],
                                    tokenize=True, return_dict=True, return_tensors="pt",
                                    sanitize_control_tokens=True)
        else:  # processors without a template (BLIP-style) place the image themselves
            if len(request.messages) > 1 or more:
                raise PoolError(ErrorCode.BAD_REQUEST, f"model {self.key!r} has no chat "
                                "template: it answers one question about an image, not a chat")
            question = request.messages[0].content if request.messages else request.prompt
            inputs = self.processor(images=rgb[0], text=question or DEFAULT_PROMPT,
                                    return_tensors="pt")
        device = self.model.device
        return {name: (value.to(device, self.model.dtype) if value.is_floating_point()
                       else value.to(device)) if isinstance(value, torch.Tensor) else value
                for name, value in inputs.items()}

    def _checked_inputs(self, image: Image.Image, request: Describe,
                        more: Sequence[Image.Image]) -> tuple[dict[str, torch.Tensor], int, int]:
        """The model's inputs, the prompt's length and how many tokens may follow it."""
        check_logit_bias(request.sampling, self.vocab, self.key)
        inputs = self.prompt_inputs(image, request, more)
        n_prompt = int(inputs["input_ids"].shape[1])  # image tokens included: they use context
        if n_prompt >= self.context:
            raise PoolError(ErrorCode.BAD_REQUEST, f"prompt has {n_prompt} tokens (image "
                            f"included); model {self.key!r} has a context of {self.context}")
        check_prompt_logprobs(request.sampling, n_prompt, self.vocab, self.key)
        assert request.sampling.max_tokens is not None, "the daemon fills in defaults"
        return inputs, n_prompt, min(request.sampling.max_tokens, self.context - n_prompt)

    def decoder(self) -> ContinuousDecoder | None:
        """Continuous batching of the language model's sequences, if it allows it: each
        prompt (image included) is prefilled alone, then decoded with the others."""
        if batch_fit.unsupported(self.model) is not None:
            return None
        return ContinuousDecoder(self.model, self.tokenizer, self.eos_ids)

    def prepare(self, image: Image.Image, request: Describe,
                more: Sequence[Image.Image] = ()) -> Prepared:
        inputs, n_prompt, budget = self._checked_inputs(image, request, more)
        return Prepared(inputs=inputs, prompt_tokens=n_prompt, budget=budget,
                        sampling=request.sampling, grammar=self.language(request),
                        reasoning=self.reasoning_reader(request),
                        tool_calls=self.tool_reader(request), kept=self._kept(request))

    @torch.inference_mode()
    def describe(self, image: Image.Image, request: Describe, stats: GenerationStats,
                 more: Sequence[Image.Image] = ()) -> Iterator[str]:
        inputs, n_prompt, budget = self._checked_inputs(image, request, more)
        stats.prompt_tokens = n_prompt
        mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))

        def next_inputs(token: int) -> dict[str, torch.Tensor]:
            # The full mask keeps positions right for models that derive them from it.
            nonlocal mask
            mask = torch.cat([mask, mask.new_ones((1, 1))], dim=1)
            return {"input_ids": torch.tensor([[token]], device=mask.device),
                    "attention_mask": mask}

        yield from decode(self.model, inputs, next_inputs, budget, request.sampling,
                          self.eos_ids, self.tokenizer, stats, self.language(request),
                          self._kept(request))


def vision_chat(prompt: str, messages: list[ChatMessage],
                images: list[tuple[int, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The chat a processor's template renders: the request's messages, each image (by
    its message's index) that many characters into its text, in order, or its one
    question (no question, and the images the chat's last message alone: a caption is
    asked for)."""
    messages = list(messages) or [ChatMessage(role="user", content=prompt)]
    if not messages[-1].content and any(at == len(messages) - 1 for at, _, _ in images):
        messages[-1:] = [ChatMessage(role=messages[-1].role, content=DEFAULT_PROMPT)]
    turns = []
    for index, message in enumerate(messages):
        parts, done = [], 0
        for _, offset, image in sorted((i for i in images if i[0] == index),
                                       key=lambda i: i[1]):
            parts += [{"type": "text", "text": message.content[done:offset]}] * (offset > done)
            parts.append(image)
            done = max(done, offset)
        parts.append({"type": "text", "text": message.content[done:]})
        turns.append({**template_message(message), "content": parts})
    return turns


def _config_eos(config: Any) -> set[int]:
    # Composite configs may keep eos only in their text half.
    value = getattr(config, "eos_token_id", None)
    if isinstance(value, int):
        return {value}
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


def load(spec: ModelSpec, model_dir: Path | None) -> VisionLM:
    model_dir = require_dir(spec, model_dir)
    processor = AutoProcessor.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    if getattr(processor, "tokenizer", None) is None:
        raise ValueError(f"model {spec.key!r}: its processor has no tokenizer")
    model = place(spec, AutoModelForImageTextToText.from_pretrained(
        model_dir, **pretrained_kwargs(spec)))
    own = own_tokens(model.config.get_text_config(), 2048)
    template = str(getattr(processor, "chat_template", None) or "") or None
    thinking = thinking_tags(template, spec.options.get("reasoning_format"), spec.key)
    tool_format = format_of(template, spec.options.get("tool_call_format"), spec.key)
    return VisionLM(spec.key, processor, model, configured_tokens(spec, "context", own),
                    thinking, structured_in_reasoning(spec), tool_format)
