"""Structured output's cost for scripts/bench.py (`--only structured`), in this process.

- tiny-llm (a 1,024-token vocabulary): greedy decoding one sequence at a time
  (`CausalLM.generate`), the time per output token of a JSON Schema's object and of free
  text of as many tokens from the same prompt, in turns (the matcher's making counted
  in). Its forward pass is tiny, so the grammar's share of a token is as large as it
  gets here.
- The mask's own cost at the vocabularies real models have: byte-level BPE tokenizers of
  32,000 and 128,000 tokens, trained here on the Python standard library's sources (no
  download), walked through a JSON Schema by random logits: per token, llguidance's mask
  applied to the logits and the token consumed; reading the vocabulary into
  llguidance, once per model; and a new sequence's matcher, its grammar compiled and
  copied from the one kept compiled.
"""

from __future__ import annotations

import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 12}},
                         "ok": {"type": "boolean"}}}
STEPS = 2_000
CORPUS_CHARS = 60_000_000


def _tiny_llm(quick: bool) -> dict[str, Any]:
    import tempfile

    import make_tiny_models

    from modelpool.protocol import kinds
    from modelpool.registry.loaders import load_model
    from modelpool.registry.spec import ModelSpec
    from modelpool.workers.capabilities.text_to_text import GenerationStats

    with tempfile.TemporaryDirectory(prefix="mpbench-structured-") as root:
        make_tiny_models._quiet_transformers()
        path = make_tiny_models.build_model("tiny-llm", Path(root))
        model: Any = load_model(ModelSpec(key="tiny-llm", capability="text_to_text",
                                          path=str(path)))
        per_token: dict[str, list[float]] = {"free": [], "json_schema": []}
        for turn in range(10 if quick else 40):
            tokens = 64
            # The object first; then free text of as many tokens (the same prompt pass
            # and steps: only the language differs).
            for name, extra in (("json_schema", {"json_schema": SCHEMA}),
                                ("free", {"ignore_eos": True})):
                request = kinds.build("generate", f"record {turn}:", max_tokens=tokens,
                                      temperature=0, raw=True, **extra)
                stats = GenerationStats()
                t0 = time.perf_counter()
                "".join(model.generate(request, stats))
                per_token[name].append((time.perf_counter() - t0) / stats.completion_tokens)
                tokens = stats.completion_tokens
    free, held = (statistics.median(per_token[n]) * 1e6 for n in ("free", "json_schema"))
    return {"vocab": 1024, "us_per_token_free": round(free, 1),
            "us_per_token_json_schema": round(held, 1),
            "ratio": round(held / free, 2), "sequences_each": len(per_token["free"])}


def _corpus() -> list[str]:
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size > CORPUS_CHARS:
            break
    return texts


def _bpe(texts: list[str], vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def _mask_walk(tokenizer: Any, steps: int) -> dict[str, Any]:
    import torch

    from modelpool.protocol.builders import structured
    from modelpool.registry.loaders.grammar import Grammars

    vocab = len(tokenizer)
    eos = int(tokenizer.eos_token_id)
    grammars = Grammars(tokenizer, vocab, {eos})
    t0 = time.perf_counter()
    grammars.vocabulary()  # read into llguidance, once per model
    read_s = time.perf_counter() - t0
    wanted = structured(json_schema=SCHEMA)
    compiles, copies = [], []
    for _ in range(30):  # a new sequence's matcher: compiled, and from the compiled one kept
        t0 = time.perf_counter()
        grammars.compile(wanted)
        t1 = time.perf_counter()
        grammars.matcher(wanted)
        copies.append(time.perf_counter() - t1)
        compiles.append(t1 - t0)
    generator = torch.Generator().manual_seed(0)
    masks, adds, outputs = [], [], 0
    matcher = grammars.matcher(wanted)
    for _ in range(steps):
        assert matcher is not None
        logits = torch.randn(vocab, generator=generator)
        t0 = time.perf_counter()
        token = int(torch.argmax(matcher.mask(logits)))
        t1 = time.perf_counter()
        matcher.add(token)
        adds.append(time.perf_counter() - t1)
        masks.append(t1 - t0)
        if token == eos:  # one object done: start the next
            outputs += 1
            matcher = grammars.matcher(wanted)
    return {"vocab": vocab, "vocabulary_read_s": round(read_s, 3),
            "matcher_compiled_ms_p50": round(statistics.median(compiles) * 1e3, 3),
            "matcher_kept_ms_p50": round(statistics.median(copies) * 1e3, 3),
            "mask_us_p50": round(statistics.median(masks) * 1e6, 1),
            "consume_us_p50": round(statistics.median(adds) * 1e6, 1),
            "tokens": steps, "objects_completed": outputs}


def figures(quick: bool) -> dict[str, Any]:
    texts = _corpus()
    steps = STEPS // 4 if quick else STEPS
    return {"tiny_llm": _tiny_llm(quick),
            "mask": [_mask_walk(_bpe(texts, vocab), steps) for vocab in (32_000, 128_000)]}
