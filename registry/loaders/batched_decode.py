"""Continuous batching for decoder-only transformers: every running sequence of a model
goes through one forward pass per step, and sequences join and leave between steps.

A new sequence is prefilled (short text prompts several in one padded pass, a long one in
chunks, so that a pass costs about a few decode steps and stalls the others no longer), then
its KV cache joins the running batch, left-padded to the batch's length; a sequence that
ends leaves at once and its rows of the cache are dropped. With a prefix cache
(prefix_cache.py), a text sequence's keys and values are kept when its prompt is in and
when it ends, and a new prompt starts from the longest kept one it begins with, fed in
chunks from there; one prompt sent several times at once (n choices) is prefilled once.
Sampling stays per sequence (temperature, top_p, top_k, min_p, logit rules, seed, stop
tokens, ignore_eos, logprobs), with the same `next_token`, detokenizer and token
logprobs as causal_lm.py's loop.

It needs a model whose cache is a plain DynamicCache (full attention in every layer, no
sliding window or recurrent state) and whose positions are one index per token, taken
from `position_ids`: Llama, Mistral without a sliding window, Qwen2/3, Phi-3, GPT-2, LLaVA
on any of those. `batch_fit.unsupported` says why another is not (it runs one at a time).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from modelpool.protocol.messages import Sampling, TokenLogprob
from modelpool.registry.loaders import continued_prefill, prefill_groups
from modelpool.registry.loaders.batch_fit import default_max_sequences
from modelpool.registry.loaders.common import kv_cache_keyword, kv_cache_of
from modelpool.registry.loaders.grammar import GrammarMatcher
from modelpool.registry.loaders.harmony import HarmonyCalls, HarmonyReader
from modelpool.registry.loaders.kv_rows import Rows, row_of
from modelpool.registry.loaders.logit_rules import LogitRules
from modelpool.registry.loaders.prefix_cache import PrefixCache, shared_prefix
from modelpool.registry.loaders.reasoning import ReasoningReader
from modelpool.registry.loaders.token_logprobs import prompt_logprobs, token_logprob
from modelpool.registry.loaders.tool_calls import ToolCallReader
from modelpool.workers.capabilities.text_to_text import GenerationStats

# Padded prompt tokens per prefill pass at least (short prompts share one, a long one is
# cut into chunks of this many). On the CPU a pass is compute-bound: 128 tokens of a
# 100M-parameter Llama take about four decode steps of 16 sequences here. A GPU takes far
# more at once.
PREFILL_TOKENS_CPU = 128
PREFILL_TOKENS_GPU = 1024
# More, when the model is fast enough: a pass may stall the running sequences as long as
# this many of their decode steps (as measured), and take this many times the least when
# none runs, so that prompts arriving together start together.
STALL_STEPS = 4
IDLE_FACTOR = 8


@dataclass
class Prepared:
    """One sequence ready to start: its prompt as the model's batch-1 inputs."""

    inputs: dict[str, torch.Tensor]  # input_ids (1, n), and pixel_values etc. for vision
    prompt_tokens: int
    budget: int  # tokens it may generate: max_tokens, cut to the context left
    sampling: Sampling
    grammar: GrammarMatcher | None = None  # structured output: its place in the language
    tool_calls: ToolCallReader | HarmonyCalls | None = None  # tool_choice "auto": its calls
    reasoning: ReasoningReader | HarmonyReader | None = None  # reads a model's thinking
    kept: dict[int, str] | None = None  # special tokens its text keeps (the calls' markers)
    cache_salt: str = ""  # kept prompts are shared only among sequences of the same salt


@dataclass
class Emitted:
    """What one step did for one sequence: a text piece (maybe ""), its token's logprob if
    asked for, its end if it ended (stats set) or failed (error set: it has left)."""

    seq_id: int
    text: str = ""
    logprob: TokenLogprob | None = None
    stats: GenerationStats | None = None
    error: BaseException | None = None
    tokens: int = 1  # the piece's tokens: 0 for an end's text the decoder held


@dataclass(eq=False)
class _Seq:
    seq_id: int
    prepared: Prepared
    generator: torch.Generator
    detok: Any  # causal_lm.IncrementalDecoder
    stats: GenerationStats = field(default_factory=GenerationStats)
    fed: int = 0  # prompt tokens prefilled so far (chunked prefill)
    cache: DynamicCache | None = None  # its own cache while its prompt is fed in chunks
    token: int = -1  # the last sampled token: the input of its next decode step
    rules: LogitRules | None = None  # biases, penalties, min_tokens: None when none

    @property
    def plain(self) -> bool:
        """Text only, and no prompt logprobs (they need the whole prompt's logits): may
        share a padded prefill pass, or be fed in chunks."""
        return (set(self.prepared.inputs) <= {"input_ids", "attention_mask"}
                and self.prepared.sampling.prompt_logprobs is None)

    @property
    def left(self) -> int:
        return self.prepared.prompt_tokens - self.fed


class ContinuousDecoder:
    """Sequences of one model, stepped together. Single-threaded: add, drop and step are
    called between steps by the worker's loop."""

    def __init__(self, model: Any, tokenizer: Any, eos_ids: set[int],
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.cache_keyword = kv_cache_keyword(model)
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                          else next(iter(eos_ids), 0))
        self.default_max_sequences = default_max_sequences(model)
        self.least_prefill = (PREFILL_TOKENS_CPU if model.device.type == "cpu"
                              else PREFILL_TOKENS_GPU)
        self.prefill_tokens = self.least_prefill  # this pass's budget (prefill_budget)
        self.token_s = 0.0  # a padded prompt token's prefill time, as measured
        self.step_s = 0.0  # a decode step's time, as measured
        self.waiting: list[_Seq] = []  # not yet (fully) prefilled, in arrival order
        self.rows = Rows()
        self.prefilled_last = False

    def __len__(self) -> int:
        return len(self.waiting) + len(self.rows.seqs)

    def add(self, seq_id: int, prepared: Prepared) -> None:
        from modelpool.registry.loaders.causal_lm import IncrementalDecoder

        sampling = prepared.sampling
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8))
        self.waiting.append(_Seq(
            seq_id, prepared, torch.Generator().manual_seed(seed),
            IncrementalDecoder(self.tokenizer, prepared.kept),
            rules=LogitRules.of(sampling, prepared.inputs["input_ids"], self.eos_ids,
                                prepared.grammar)))

    def drop(self, seq_id: int) -> GenerationStats | None:
        """It leaves now (aborted, or a stop string ended it): its stats so far, or None
        for an id it does not have."""
        found = [s for s in (*self.waiting, *self.rows.seqs) if s.seq_id == seq_id]
        self.waiting = [s for s in self.waiting if s.seq_id != seq_id]
        self._leave({seq_id})
        if not found:
            return None
        found[0].stats.prompt_tokens = found[0].prepared.prompt_tokens
        return found[0].stats

    @torch.inference_mode()
    def step(self) -> list[Emitted]:
        """One forward pass: a prefill when sequences wait (alternating with decode steps
        while others run, so neither starves), else one token for every running one."""
        started = time.perf_counter()
        if self.waiting and not (self.prefilled_last and self.rows.seqs):
            self.prefilled_last = True
            self.prefill_tokens = self.prefill_budget()
            self._reuse_prefixes()
            group = prefill_groups.next_group(self.waiting, self.prefill_tokens,
                                              self._prompt_key, self._shared_start)
            longest = max(s.left for s in group) or 1
            unique, rows = prefill_groups.once_each(group, self._prompt_key)
            tokens = len(unique) * (min(longest, self.prefill_tokens)
                                    if self._chunked(group) else longest)
            events = self._prefill(group, unique, rows)
            self.token_s = _average(self.token_s, (time.perf_counter() - started) / tokens)
            return events
        self.prefilled_last = False
        if not self.rows.seqs:
            return []
        events = self._decode()
        self.step_s = _average(self.step_s, time.perf_counter() - started)
        return events

    def prefill_budget(self) -> int:
        """Padded prompt tokens for the next prefill pass: what stalls the running
        sequences STALL_STEPS decode steps, or IDLE_FACTOR times the least when none runs
        (the least until both are measured)."""
        if not self.token_s or not self.step_s:
            return self.least_prefill
        if not self.rows.seqs:
            return IDLE_FACTOR * self.least_prefill
        fits = int(STALL_STEPS * self.step_s / self.token_s)
        return max(self.least_prefill, min(fits, IDLE_FACTOR * self.least_prefill))

    # ---- prefill ---------------------------------------------------------------------

    def _prefill(self, group: list[_Seq], unique: list[_Seq],
                 rows: torch.Tensor) -> list[Emitted]:
        """`unique`: the group's distinct prompts, `rows` each sequence's among them."""
        try:
            if self._chunked(group):
                return self._prefill_chunk(group[0])
            if group[0].fed:
                logits, cache, mask = self._prefill_rests(group)
            else:
                logits, cache, mask = self._prefill_once_each(group, unique, rows)
        except Exception as exc:
            self.waiting = [s for s in self.waiting if s not in group]
            return [Emitted(s.seq_id, error=exc) for s in group]
        self.waiting = [s for s in self.waiting if s not in group]
        for row, seq in enumerate(group):
            self._remember(seq, cache, row, seq.prepared.prompt_tokens)
        self.rows.join(group, cache, mask)
        return self._advance(group, logits)

    def _prefill_once_each(self, group: list[_Seq], unique: list[_Seq], rows: torch.Tensor
                           ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Prompts prefilled whole, each distinct one once, in one padded pass."""
        logits, cache, mask = self._prefill_whole(unique)
        if len(unique) < len(group):  # each its own copy of its prompt's row
            logits, mask = logits[rows], mask[rows]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        return logits, cache, mask

    def _prefill_rests(self, group: list[_Seq]
                       ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Prompts each with keys and values of their own for a start (continued_prefill):
        the rest of every one in one pass."""
        fed = [seq.fed for seq in group]
        cache, cached = continued_prefill.batch_of([seq.cache for seq in group], fed)
        ids, new = continued_prefill.left_padded(
            [seq.prepared.inputs["input_ids"][0, seq.fed:] for seq in group], self.pad_id)
        mask, device = torch.cat([cached, new], dim=1), self.model.device
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                         position_ids=continued_prefill.positions_after(fed, new).to(device),
                         **{self.cache_keyword: cache}, use_cache=True, logits_to_keep=1)
        cache = kv_cache_of(out)
        for seq in group:
            seq.fed, seq.cache = seq.prepared.prompt_tokens, None
        return out.logits[:, -1], cache, continued_prefill.left_aligned(cache, mask)

    def _prompt_key(self, seq: _Seq) -> object:
        """Equal for prompts prefilled once for all (a request's n choices, each sampled
        on its own, are one prompt sent n times). Sharing keys and values is the prefix
        cache's part: with it off, and between salts, each is prefilled as sent."""
        if self.prefix_cache is None:
            return seq
        ids = seq.prepared.inputs["input_ids"][0]
        return seq.prepared.cache_salt, ids.cpu().numpy().tobytes()

    def _shared_start(self, kept: _Seq, seq: _Seq) -> int:
        """Tokens seq's prompt may take from kept's once kept's is in the prefix cache."""
        if self.prefix_cache is None or kept.prepared.cache_salt != seq.prepared.cache_salt:
            return 0
        return shared_prefix(kept.prepared.inputs["input_ids"][0],
                             seq.prepared.inputs["input_ids"][0])

    def _reuse_prefixes(self) -> None:
        """Waiting prompts not started that start as a kept one does start from its cache,
        and are fed from there (their rests together, a long one in chunks). Asked again
        at each prefill while they wait: the sequence prefilled just before may have been
        the one they share a start with."""
        if self.prefix_cache is None:
            return
        for seq in self.waiting:
            if seq.fed or not seq.plain:
                continue
            length, cache = self.prefix_cache.take(seq.prepared.inputs["input_ids"][0],
                                                   seq.prepared.cache_salt)
            if cache is not None:
                seq.cache, seq.fed, seq.stats.cached_tokens = cache, length, length

    def _remember(self, seq: _Seq, cache: DynamicCache, row: int, tokens: int) -> None:
        """Keep a text sequence's keys and values, the last `tokens` of its row of
        `cache`: its prompt's, or its prompt's and its output's."""
        if self.prefix_cache is None or not seq.plain:
            return
        prompt = seq.prepared.inputs["input_ids"][0].cpu()
        output = torch.tensor(seq.detok.tokens, dtype=prompt.dtype)  # every token it took
        self.prefix_cache.keep(torch.cat([prompt, output])[:tokens], seq.prepared.cache_salt,
                               lambda: row_of(cache, row, tokens))

    def _leave(self, seq_ids: set[int]) -> None:
        """These leave the running batch; their keys and values are kept first."""
        rows = self.rows
        for row, seq in enumerate(rows.seqs):
            if seq.seq_id in seq_ids and rows.cache is not None:
                self._remember(seq, rows.cache, row, rows.real_tokens(row))
        rows.keep([i for i, s in enumerate(rows.seqs) if s.seq_id not in seq_ids])

    def _chunked(self, group: list[_Seq]) -> bool:
        """Whether this prefill is the next chunk of one long prompt: text only, whose ids
        alone are its inputs (an image's prompt is prefilled whole)."""
        first = group[0]
        return len(group) == 1 and first.plain and (first.left > self.prefill_tokens
                                                    or bool(first.fed))

    def _prefill_whole(self, group: list[_Seq]
                       ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        if len(group) == 1:
            seq = group[0]
            inputs = dict(seq.prepared.inputs)
            ids = inputs["input_ids"]
            mask = inputs.pop("attention_mask", torch.ones_like(ids))
            top = seq.prepared.sampling.prompt_logprobs
            out = self.model(**inputs, use_cache=True, logits_to_keep=0 if top is not None
                             else 1)
            if top is not None:
                seq.stats.prompt_logprobs = prompt_logprobs(out.logits[0], ids[0].tolist(),
                                                            top, self.tokenizer)
            return out.logits[:, -1], kv_cache_of(out), mask.to("cpu", torch.long)
        length = max(s.left for s in group)
        ids = torch.full((len(group), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), length), dtype=torch.long)
        for row, seq in enumerate(group):
            prompt = seq.prepared.inputs["input_ids"][0]
            ids[row, length - len(prompt):] = prompt.cpu()
            mask[row, length - len(prompt):] = 1
        device = self.model.device
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device),
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], kv_cache_of(out), mask

    def _prefill_chunk(self, seq: _Seq) -> list[Emitted]:
        """One chunk of a long prompt into the sequence's own cache; the last chunk joins
        it to the batch and samples its first token."""
        ids = seq.prepared.inputs["input_ids"][:, seq.fed:seq.fed + self.prefill_tokens]
        out = self.model(input_ids=ids, **{self.cache_keyword: seq.cache}, use_cache=True,
                         logits_to_keep=1)
        seq.cache, seq.fed = kv_cache_of(out), seq.fed + ids.shape[1]
        if seq.left > 0:
            return []
        self.waiting.remove(seq)
        cache, seq.cache = seq.cache, None
        self._remember(seq, cache, 0, seq.fed)
        self.rows.join([seq], cache, torch.ones((1, seq.fed), dtype=torch.long))
        return self._advance([seq], out.logits[:, -1])

    # ---- decode ----------------------------------------------------------------------

    def _decode(self) -> list[Emitted]:
        rows = self.rows
        device = self.model.device
        ids = torch.tensor([[s.token] for s in rows.seqs], device=device)
        mask = F.pad(rows.mask, (0, 1), value=1)
        try:
            out = self.model(
                input_ids=ids, attention_mask=None if bool(mask.all()) else mask.to(device),
                position_ids=rows.positions[:, None].to(device),
                **{self.cache_keyword: rows.cache}, use_cache=True, logits_to_keep=1)
        except Exception as exc:
            failed, self.rows = rows.seqs, Rows()
            return [Emitted(s.seq_id, error=exc) for s in failed]
        rows.mask, rows.positions = mask, rows.positions + 1
        return self._advance(list(rows.seqs), out.logits[:, -1])

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> list[Emitted]:
        """Sample each sequence's next token from its row of logits (rows in the order of
        seqs); the sequences that end leave the batch."""
        from modelpool.registry.loaders.causal_lm import GREEDY_BELOW, next_token

        logits = logits.float().cpu()
        greedy = logits.argmax(dim=-1).tolist()
        events = []
        for row, seq in enumerate(seqs):
            sampling = seq.prepared.sampling
            assert sampling.temperature is not None
            plain_greedy = sampling.temperature < GREEDY_BELOW and seq.rules is None
            token = greedy[row] if plain_greedy else next_token(
                logits[row], sampling, seq.generator, seq.rules)
            events.append(self._take(seq, token, logits[row]))
        ended = {e.seq_id for e in events if e.stats is not None}
        if ended:
            self._leave(ended)
        return events

    def _take(self, seq: _Seq, token: int, logits: torch.Tensor) -> Emitted:
        from modelpool.registry.loaders.causal_lm import ends

        stats, sampling = seq.stats, seq.prepared.sampling
        stats.prompt_tokens = seq.prepared.prompt_tokens
        if ends(token, sampling, self.eos_ids):
            stats.finish_reason = "stop"
            return Emitted(seq.seq_id, seq.detok.flush(), stats=stats, tokens=0)
        stats.completion_tokens += 1
        seq.token = token
        text = seq.detok.add(token)
        logprob = None if sampling.logprobs is None else token_logprob(
            logits, token, sampling.logprobs, self.tokenizer)
        if stats.completion_tokens >= seq.prepared.budget:
            stats.finish_reason = "length"
            return Emitted(seq.seq_id, text + seq.detok.flush(), logprob, stats)
        return Emitted(seq.seq_id, text, logprob)


def _average(mean: float, sample: float) -> float:
    """A moving average that follows the last ten or so samples."""
    return sample if not mean else 0.8 * mean + 0.2 * sample
