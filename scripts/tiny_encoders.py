"""Tiny encoder models for make_tiny_models.py: a BERT cross-encoder for rerank.

    tiny-rerank  BertForSequenceClassification (one relevance logit), WordPiece tokenizer
                 that encodes (query, document) pairs as [CLS] q [SEP] d [SEP]    ~0.2 MB
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
RERANK_VOCAB_SIZE = 512
RERANK_CONTEXT = 128


def wordpiece_tokenizer(lines: list[str]) -> Any:
    """A BERT-style uncased WordPiece tokenizer that knows sentence pairs. Its vocabulary
    is built here rather than by the tokenizers trainer, whose choices vary from process
    to process: the specials, every character alone and as a "##" continuation, then the
    corpus's most frequent words."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words: Counter[str] = Counter(
        word for line in lines
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line)))
    chars = sorted({char for word in words for char in word})
    tokens = [*BERT_SPECIALS, *chars, *(f"##{c}" for c in chars)]
    room = RERANK_VOCAB_SIZE - len(tokens)
    tokens += [w for w, _ in sorted(words.items(), key=lambda wc: (-wc[1], wc[0]))
               if len(w) > 1][:room]
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)},
                                           unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    cls, sep = tokens.index("[CLS]"), tokens.index("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def build_tiny_rerank(outdir: Path, lines: list[str],
                      seeded: Callable[[], contextlib.AbstractContextManager[None]]) -> Path:
    """Write OUTDIR/tiny-rerank: a cross-encoder that scores (query, document) pairs, laid
    out as cross-encoder checkpoints on the hub are (config, safetensors, tokenizer)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    model_dir = outdir / "tiny-rerank"
    tokenizer = BertTokenizerFast(
        tokenizer_object=wordpiece_tokenizer(lines), unk_token="[UNK]", sep_token="[SEP]",
        pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
        model_max_length=RERANK_CONTEXT)
    tokenizer.save_pretrained(model_dir)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=RERANK_CONTEXT, num_labels=1,
                        pad_token_id=tokenizer.pad_token_id,
                        initializer_range=0.3)  # logits that tell documents apart
    with seeded():
        model = BertForSequenceClassification(config).eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir
