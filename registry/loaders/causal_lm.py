"""Causal language models with transformers: token-by-token decoding with a KV cache,
so the worker can stream, count progress and stop between any two tokens."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import Generate, Sampling
from modelpool.registry.loaders import batch_fit, harmony
from modelpool.registry.loaders.batched_decode import ContinuousDecoder, Prepared
from modelpool.registry.loaders.chat_prompt import chat_ids, template_message
from modelpool.registry.loaders.common import (
    configured_tokens,
    kv_cache_keyword,
    kv_cache_of,
    last_logits_only,
    own_tokens,
    place,
    pretrained_kwargs,
    require_dir,
    vocab_size,
)
from modelpool.registry.loaders.grammar import AfterThinking, GrammarMatcher, Grammars
from modelpool.registry.loaders.harmony import HarmonyCalls, HarmonyReader
from modelpool.registry.loaders.logit_rules import LogitRules, check_logit_bias
from modelpool.registry.loaders.prefix_cache import PrefixCache
from modelpool.registry.loaders.reasoning import (
    PROMPT_TAIL,
    ReasoningReader,
    one_token,
    opens_thinking,
    structured_in_reasoning,
    thinking_tags,
)
from modelpool.registry.loaders.token_logprobs import (
    check_prompt_logprobs,
    prompt_logprobs,
    token_logprob,
)
from modelpool.registry.loaders.tool_calls import (
    ToolCallReader,
    auto_reader,
    format_of,
    function_names,
    kept_tokens,
)
from modelpool.registry.spec import ModelSpec
from modelpool.workers.capabilities.text_to_text import GenerationStats


class CausalLM:
    def __init__(self, key: str, tokenizer: Any, model: Any, context: int,
                 tool_call_format: str | None = None,
                 prefix_cache_bytes: int | None = None,
                 reasoning_format: str | None = None,
                 structured_in_reasoning: bool = False) -> None:
        self.key = key
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.context = context  # prompt and output tokens together
        self.eos_ids = eos_ids_of(model, tokenizer)
        self.vocab = vocab_size(model)
        self.grammars = Grammars(tokenizer, self.vocab, self.eos_ids)
        template = str(tokenizer.chat_template) if tokenizer.chat_template else None
        # gpt-oss's channels hold both its thinking and its calls
        self.harmony = harmony.used(template, tool_call_format, reasoning_format)
        self.harmony_markers = kept_tokens(tokenizer, harmony.MARKERS if self.harmony else ())
        self.tool_format = None if self.harmony else format_of(template, tool_call_format, key)
        self.tool_markers = kept_tokens(tokenizer, self.tool_format.markers
                                        if self.tool_format else ())
        self.thinking = None if self.harmony else thinking_tags(template, reasoning_format, key)
        self.reasoning_markers = kept_tokens(tokenizer, (
            self.thinking.opens, self.thinking.closes) if self.thinking else ())
        # a structured output's language holds the thinking too (vLLM's enable_in_reasoning)
        self.structured_in_reasoning = structured_in_reasoning
        self.open_token = one_token(tokenizer, self.thinking.opens) if self.thinking else None
        self.batchable = batch_fit.unsupported(model) is None  # continuously
        # the prefix cache's budget (0: none, as for a model that cannot batch continuously);
        # None: the default share of memory
        if not self.batchable:
            prefix_cache_bytes = 0
        self.prefix_cache_bytes = (batch_fit.default_prefix_cache_bytes(model)
                                   if prefix_cache_bytes is None else prefix_cache_bytes)
        # The last request's prompt: its readers and its generation both ask for it
        self._last_prompt: tuple[Generate, list[int]] | None = None

    def info(self) -> dict[str, Any]:
        return {"context": self.context, "chat_template": bool(self.tokenizer.chat_template),
                "tool_call_format": harmony.FORMAT if self.harmony else
                self.tool_format.name if self.tool_format else None,
                "reasoning_format": harmony.FORMAT if self.harmony else
                self.thinking.name if self.thinking else None,
                "prefix_cache_mb": round(self.prefix_cache_bytes / (1 << 20), 1)}

    def prompt_ids(self, request: Generate) -> list[int]:
        if self._last_prompt is None or self._last_prompt[0] is not request:
            self._last_prompt = (request, self._tokenized(request))
        return list(self._last_prompt[1])

    def _tokenized(self, request: Generate) -> list[int]:
        if request.prompt_ids:
            outside = [t for t in request.prompt_ids if self.vocab and t >= self.vocab]
            if outside:
                raise PoolError(ErrorCode.BAD_REQUEST, f"prompt_ids: token {outside[0]} is "
                                f"not one of model {self.key!r}'s {self.vocab}")
            return list(request.prompt_ids)
        template = self.tokenizer.chat_template
        if request.messages or (template and not request.raw):
            if not template:
                raise PoolError(ErrorCode.BAD_REQUEST,
                                f"model {self.key!r} has no chat template: send a prompt")
            messages = [template_message(m) for m in request.messages] or [
                {"role": "user", "content": request.prompt}]
            return chat_ids(self.tokenizer, self.key, messages, request.tools,
                            request.chat_template_kwargs, request.reasoning_effort)
        return list(self.tokenizer(request.prompt)["input_ids"])

    def _checked_ids(self, request: Generate) -> tuple[list[int], int]:
        """The prompt's token ids and how many tokens may follow them."""
        check_logit_bias(request.sampling, self.vocab, self.key)
        ids = self.prompt_ids(request)
        if len(ids) >= self.context:
            raise PoolError(ErrorCode.BAD_REQUEST, f"prompt has {len(ids)} tokens; model "
                            f"{self.key!r} has a context of {self.context}")
        check_prompt_logprobs(request.sampling, len(ids), self.vocab, self.key)
        assert request.sampling.max_tokens is not None, "the daemon fills in defaults"
        return ids, min(request.sampling.max_tokens, self.context - len(ids))

    def decoder(self) -> ContinuousDecoder | None:
        """Continuous batching of many sequences, if this model allows it."""
        if not self.batchable:
            return None
        budget = self.prefix_cache_bytes
        return ContinuousDecoder(self.model, self.tokenizer, self.eos_ids,
                                 PrefixCache(budget) if budget else None)

    def prepare(self, request: Generate) -> Prepared:
        """A sequence for the decoder; raises PoolError for a prompt too long."""
        ids, budget = self._checked_ids(request)
        calls, reasoning = self.readers(request, ids)
        return Prepared(inputs={"input_ids": torch.tensor([ids], device=self.model.device)},
                        prompt_tokens=len(ids), budget=budget, sampling=request.sampling,
                        grammar=self.language(request, ids),
                        tool_calls=calls, kept=self._kept(request), reasoning=reasoning,
                        cache_salt=request.cache_salt)

    def readers(self, request: Generate, ids: list[int] | None = None
                ) -> tuple[ToolCallReader | HarmonyCalls | None,
                           ReasoningReader | HarmonyReader | None]:
        """What reads the calls (tool_choice "auto") and the thinking out of the output:
        for a harmony chat, one reader of its channels."""
        if self.harmony and self._chat(request):
            channels = HarmonyReader(reads_calls=request.tool_choice == "auto")
            calls = HarmonyCalls(channels, function_names(request.tools))
            return (calls if request.tool_choice == "auto" else None), channels
        return self.tool_reader(request), self.reasoning_reader(request, ids)

    def tool_reader(self, request: Generate) -> ToolCallReader | None:
        """What reads the calls out of the output (tool_choice "auto"), else None."""
        return auto_reader(self.tool_format, self.key, request)

    def reasoning_reader(self, request: Generate,
                         ids: list[int] | None = None) -> ReasoningReader | None:
        """What reads the thinking out of the output of a model that reasons, for a chat
        (not a raw prompt, whose text is the client's to read). A prompt (`ids`) that
        ends by opening the thinking (the template's doing) has the output start inside
        it; held to a language (structured output), the output is the answer unless it
        opens the thinking itself (`structured_in_reasoning`; else the language starts
        after the thinking: `language`)."""
        if self.thinking is None or not self._reads_thinking(request):
            return None
        if request.sampling.structured is not None and self.structured_in_reasoning:
            return ReasoningReader(False, self.thinking)
        return ReasoningReader(self._opened(request, ids), self.thinking)

    def language(self, request: Generate, ids: list[int]) -> GrammarMatcher | None:
        """What holds the output to the request's language (structured output), None
        when it asks for none; a reasoning model's thinks first, as vLLM's does (a
        harmony model's channels are free until its final one)."""
        grammar = self.grammars.matcher(request.sampling.structured)
        if grammar is None or self.structured_in_reasoning or not self._chat(request):
            return grammar
        if self.harmony:
            return AfterThinking(grammar, harmony.FINAL, self.tokenizer, True, None)
        if self.thinking is None:
            return grammar
        return AfterThinking(grammar, self.thinking.closings, self.tokenizer,
                             self._opened(request, ids), self.open_token)

    def _opened(self, request: Generate, ids: list[int] | None) -> bool:
        """Whether the prompt ends by opening the thinking (the template's doing)."""
        assert self.thinking is not None
        ids = self.prompt_ids(request) if ids is None else ids
        return opens_thinking(self.tokenizer.decode(ids[-PROMPT_TAIL:]), self.thinking)

    def _reads_thinking(self, request: Generate) -> bool:
        return self.thinking is not None and self._chat(request)

    def _chat(self, request: Generate) -> bool:
        """The prompt is the template's: its output is read (a raw one is the client's)."""
        chat = bool(request.messages) or bool(self.tokenizer.chat_template and not request.raw)
        return chat and not request.prompt_ids

    def _kept(self, request: Generate) -> dict[int, str] | None:
        """The special tokens its text keeps: the format's markers, when it may call, and
        the thinking's tags (or harmony's), when they are read."""
        kept = {**(self.tool_markers if request.tool_choice == "auto" else {}),
                **(self.reasoning_markers if self._reads_thinking(request) else {}),
                **(self.harmony_markers if self.harmony and self._chat(request) else {})}
        return kept or None

    @torch.inference_mode()
    def generate(self, request: Generate, stats: GenerationStats) -> Iterator[str]:
        ids, budget = self._checked_ids(request)
        stats.prompt_tokens = len(ids)
        sampling = request.sampling
        device = self.model.device
        yield from decode(self.model, {"input_ids": torch.tensor([ids], device=device)},
                          lambda token: {"input_ids": torch.tensor([[token]], device=device)},
                          budget, sampling, self.eos_ids, self.tokenizer, stats,
                          self.language(request, ids), self._kept(request))


def decode(model: Any, first_inputs: dict[str, Any],
           next_inputs: Callable[[int], dict[str, Any]], budget: int, sampling: Sampling,
           eos_ids: set[int], tokenizer: Any, stats: GenerationStats,
           grammar: GrammarMatcher | None = None,
           kept: dict[int, str] | None = None) -> Iterator[str]:
    """Token by token with a KV cache: the first step runs the whole prompt, each later
    one only the new token. Yields one text piece per token (maybe "")."""
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8))
    generator = torch.Generator().manual_seed(seed)
    rules = LogitRules.of(sampling, first_inputs["input_ids"], eos_ids, grammar)
    detok = IncrementalDecoder(tokenizer, kept)
    step_inputs, past = first_inputs, None
    cache_keyword = kv_cache_keyword(model)
    keep = {} if sampling.prompt_logprobs is not None else last_logits_only(model)
    stats.finish_reason = "length"
    for step in range(budget):
        out = model(**step_inputs, **{cache_keyword: past}, use_cache=True, **keep)
        past = kv_cache_of(out)
        if step == 0 and sampling.prompt_logprobs is not None:
            stats.prompt_logprobs = prompt_logprobs(
                out.logits[0], first_inputs["input_ids"][0].tolist(), sampling.prompt_logprobs,
                tokenizer)
        logits = out.logits[0, -1].float().cpu()
        token = next_token(logits, sampling, generator, rules)
        if ends(token, sampling, eos_ids):
            stats.finish_reason = "stop"
            break
        stats.completion_tokens += 1
        if sampling.logprobs is not None:
            stats.logprob = token_logprob(logits, token, sampling.logprobs, tokenizer)
        yield detok.add(token)  # maybe "": the adapter still ticks and checks aborts
        step_inputs = next_inputs(token)
    if tail := detok.flush():
        yield tail


class IncrementalDecoder:
    """Turns tokens into text pieces without splitting a multi-byte character.

    Decodes only a short window (from the last emitted boundary), so each token costs
    the same however long the output grows. Special tokens are left out of the text,
    except `kept` ones (a tool-call format's markers), written as their text."""

    def __init__(self, tokenizer: Any, kept: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kept = kept or {}
        self.tokens: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are fully emitted
        self.read_offset = 0  # tokens before it have had their text emitted

    def _window(self) -> tuple[str, str]:
        return (self._text(self.tokens[self.prefix_offset : self.read_offset]),
                self._text(self.tokens[self.prefix_offset :]))

    def _text(self, tokens: list[int]) -> str:
        decode = self.tokenizer.decode
        if not self.kept or not self.kept.keys() & set(tokens):  # (every token: keep it cheap)
            return str(decode(tokens, skip_special_tokens=True))
        parts, run = [], []
        for token in tokens:
            if token in self.kept:
                parts += [decode(run, skip_special_tokens=True), self.kept[token]]
                run = []
            else:
                run.append(token)
        return "".join([*parts, decode(run, skip_special_tokens=True)])

    def add(self, token: int) -> str:
        self.tokens.append(token)
        prefix, text = self._window()
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete UTF-8 sequence: wait for more
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(prefix) :]

    def flush(self) -> str:
        prefix, text = self._window()
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text[len(prefix) :]


GREEDY_BELOW = 1e-5


def ends(token: int, sampling: Sampling, eos_ids: set[int]) -> bool:
    """Whether the token ends its sequence (and is not output): end-of-sequence unless
    the request ignores it, or one of the request's stop_token_ids."""
    return (token in eos_ids and not sampling.ignore_eos) or token in sampling.stop_token_ids


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator,
               rules: LogitRules | None) -> int:
    """A sequence's next token from its logits (one row, float32): biased, penalized and
    held off its end as it asks, then sampled; the rules then count it."""
    temperature, top_p = sampling.temperature, sampling.top_p
    assert temperature is not None and top_p is not None, "the daemon fills in defaults"
    if rules is not None:
        logits = rules.apply(logits)
    token = sample(logits, temperature, top_p, generator, sampling.top_k or 0,
                   sampling.min_p or 0.0)
    if rules is not None:
        rules.add(token)
    return token


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator, top_k: int = 0, min_p: float = 0.0) -> int:
    """Greedy at temperature 0 (or so close to it that float32 cannot divide by it),
    else temperature sampling among the top_k likeliest tokens (0: all), then within
    the nucleus (top_p) of those, leaving out any less likely than min_p times the
    likeliest: transformers' and vLLM's order."""
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    # From the largest logit down: a tiny temperature sends the others to -inf, not the
    # largest to +inf (inf - inf would be NaN probabilities).
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()  # the nucleus is a share of what is left
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def eos_ids_of(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def load(spec: ModelSpec, model_dir: Path | None) -> CausalLM:
    model_dir = require_dir(spec, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, local_files_only=True, trust_remote_code=spec.trust_remote_code)
    model = place(spec, AutoModelForCausalLM.from_pretrained(model_dir,
                                                             **pretrained_kwargs(spec)))
    context = configured_tokens(spec, "context", own_tokens(model.config, 2048))
    return CausalLM(spec.key, tokenizer, model, context, spec.options.get("tool_call_format"),
                    _prefix_cache_bytes(spec), spec.options.get("reasoning_format"),
                    structured_in_reasoning(spec))


def _prefix_cache_bytes(spec: ModelSpec) -> int | None:
    """The `prefix_cache_mb` option in bytes (0: none), or None for the default."""
    value = spec.options.get("prefix_cache_mb")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ValueError(f"model {spec.key!r}: prefix_cache_mb must be a whole number of "
                         f"MiB, 0 for none, not {value!r}")
    return None if value is None else value << 20
