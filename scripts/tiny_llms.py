"""Tiny text models for make_tiny_models.py: a byte-level BPE tokenizer trained on the
bundled corpus, and Llama causal LMs on it.

    tiny-llm      Llama causal LM, byte-level BPE, ChatML template            ~0.6 MB
    tiny-thinker  the same, with <think> and </think> tokens of their own and a
                  template that opens the thinking, as a reasoning model's    ~0.6 MB
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 0

# Byte-level BPE has no unknown token, so these five are all the specials we need. Their
# order fixes their ids (pad=0, bos=1, eos=2), which config.json must agree with.
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
LLM_VOCAB_SIZE = 1024

# Hand-written so the tokenizers are reproducible without any download. Varied enough that
# BPE finds LLM_VOCAB_SIZE worth of merges. Part of the digest that marks built models.
CORPUS_FILE = Path(__file__).with_name("tiny_corpus.txt")
# ChatML, as Qwen 2.5's, with tools and calls: loaders under test must cope with this shape.
CHAT_TEMPLATE_FILE = Path(__file__).with_name("tiny_chat_template.jinja")


def corpus_lines() -> list[str]:
    # Lines rather than one blob so merges never span paragraphs; the repeats give rarer
    # pairs enough counts to be merged in a stable order.
    lines = [line for line in CORPUS_FILE.read_text().splitlines() if line.strip()]
    return lines * 8


def train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer (GPT-2/Qwen style) on the bundled corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level pre-tokenizer + decoder: any text encodes and decodes back exactly,
    # spaces included, with no unknown tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    return tokenizer


def save_hf_tokenizer(tokenizer: Any, model_dir: Path, max_length: int,
                      chat_template: str | None = None) -> Any:
    """Wrap a `tokenizers.Tokenizer` as a transformers fast tokenizer and save it."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        chat_template=chat_template or CHAT_TEMPLATE_FILE.read_text(),
    )
    # Keep the chat template inside tokenizer_config.json (the pre-5.x layout) rather than
    # a separate chat_template.jinja, so older transformers releases see it too.
    hf_tokenizer.save_pretrained(model_dir, save_jinja_files=False)
    # transformers 5.x records "TokenizersBackend", a class 4.x does not know; the old
    # name still resolves to the same class in 5.x (pyproject allows transformers>=4.46).
    _update_json(model_dir / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    return hf_tokenizer


def _update_json(path: Path, **updates: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def llama_config(vocab_size: int, token_ids: dict[str, int]) -> Any:
    """A tiny Llama (about 140k parameters): tiny-llm, and the text half of tiny-vision."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, like current real models
        max_position_embeddings=2048,  # long enough for realistic prompts in tests
        tie_word_embeddings=True,  # halves the size; the loaders must handle tying anyway
        **token_ids,
    )


@contextlib.contextmanager
def seeded() -> Iterator[None]:
    """Weights identical on every run; fork_rng leaves the caller's global RNG untouched."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        yield


def save_llama(model_dir: Path, vocab_size: int, token_ids: dict[str, int]) -> None:
    """Save a seeded, randomly initialised tiny Llama causal LM."""
    from transformers import GenerationConfig, LlamaForCausalLM

    with seeded():
        model = LlamaForCausalLM(llama_config(vocab_size, token_ids)).eval()
    model.generation_config = GenerationConfig(**token_ids)
    model.save_pretrained(model_dir, safe_serialization=True)


def build_tiny_llm(outdir: Path) -> Path:
    """Write OUTDIR/tiny-llm: a tiny Llama causal LM with a byte-level BPE tokenizer."""
    model_dir = outdir / "tiny-llm"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = save_hf_tokenizer(train_tokenizer(LLM_VOCAB_SIZE), model_dir, max_length=2048)
    # len() counts added special tokens too, so every id the tokenizer can emit has an
    # embedding row.
    save_llama(model_dir, len(tokenizer), special_token_ids(tokenizer))
    return model_dir


def build_tiny_thinker(outdir: Path) -> Path:
    """Write OUTDIR/tiny-thinker: tiny-llm's tokenizer with `<think>` and `</think>` as
    tokens of their own, not special (as Qwen3's: decoding keeps them), and a chat
    template whose generation prompt opens the thinking, or with the variable
    `enable_thinking` false writes an empty one (Qwen3's switch); its own random Llama."""
    from tokenizers import AddedToken

    model_dir = outdir / "tiny-thinker"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(LLM_VOCAB_SIZE)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False)
                          for tag in ("<think>", "</think>")])
    prompt = "<|im_start|>assistant\n"
    template = CHAT_TEMPLATE_FILE.read_text()
    assert template.count(prompt) == 1
    template = template.replace(prompt, prompt + (
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"))
    hf_tokenizer = save_hf_tokenizer(tokenizer, model_dir, 2048, template)
    save_llama(model_dir, len(hf_tokenizer), special_token_ids(hf_tokenizer))
    return model_dir


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
