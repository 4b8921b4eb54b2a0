#!/usr/bin/env python
"""Build tiny random-weight models that load exactly like real Hugging Face hub models.

Tests and local runs of modelpool need real model directories (config, safetensors weights,
tokenizer, chat template) to exercise the loaders end to end, but CI has no network access
and real checkpoints are far too large to commit. Every model here is therefore built from
code, deterministically, in a few seconds, and stays small on disk:

    tiny-llm     Llama causal LM, byte-level BPE, ChatML template           ~0.6 MB
    tiny-thinker the same, <think> tokens and a template that opens them    ~0.6 MB
    tiny-clip    CLIPModel (text + vision towers) with its CLIPProcessor    ~0.4 MB
    tiny-vision  LLaVA (CLIP vision tower + tiny Llama), LlavaProcessor     ~0.7 MB
    tiny-sd      StableDiffusionPipeline (UNet, VAE, CLIP text encoder)     ~1.5 MB
    tiny-rerank  BERT cross-encoder (one relevance logit), WordPiece tokenizer ~0.2 MB

Usage:
    python scripts/make_tiny_models.py OUTDIR [--only NAME ...] [--force]

Each model lands in OUTDIR/NAME/. A marker file is written last, so a directory that has
one is complete and is skipped on later runs unless --force is given or this script has
changed since it was built.

To add a model, write a ``build_<name>(outdir) -> Path`` function that writes
OUTDIR/<name>/ and register it in BUILDERS.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # run as a script or loaded by path in tests
import tiny_encoders
from tiny_bpe import learn_bpe_merges
from tiny_llms import (
    BOS,
    EOS,
    LLM_VOCAB_SIZE,
    PAD,
    build_tiny_llm,
    build_tiny_thinker,
    corpus_lines,
    llama_config,
    seeded,
    special_token_ids,
    train_tokenizer,
)

# Heavy imports (torch, transformers, tokenizers) happen inside the builders so that
# `--help` and fully up-to-date runs stay instant.

MARKER_NAME = ".tiny-model-complete"
# Part of the digest that marks built models, with tiny_llms' corpus and chat template
SOURCES = [Path(__file__).with_name(name) for name in (
    "make_tiny_models.py", "tiny_llms.py", "tiny_bpe.py", "tiny_encoders.py",
    "tiny_corpus.txt", "tiny_chat_template.jinja")]

# ---- multimodal: tiny-clip, tiny-vision, tiny-sd ----------------------------------------

# CLIP's specials come last in its vocabulary (as in openai/clip-*): the text tower's legacy
# pooling takes the highest id in a row as its end-of-text position.
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
CLIP_MERGES = 512
CLIP_CONTEXT = 77
IMAGE_SIZE, PATCH_SIZE = 32, 8  # 16 patches: tiny vision towers
IMAGE_TOKEN = "<image>"

# ChatML whose user content may be a list of parts, the way multimodal processors render
# {"type": "image"} / {"type": "text"} messages (llava-hf templates have the same shape);
# tools as Qwen2-VL shows them: a system turn of their own, calls in Hermes' <tool_call>.
VISION_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{% for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools>\\n\\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_clip_tokenizer() -> Any:
    """A CLIPTokenizer whose BPE merges are learned from the corpus the way CLIP's were:
    lower-cased words of byte-level symbols, the last one marked word-final ("</w>")."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    # An empty CLIPTokenizer supplies CLIP's own normaliser and pre-tokeniser, so merges
    # are learned on exactly the words they will later be applied to.
    backend = CLIPTokenizer().backend_tokenizer
    words: Counter[tuple[str, ...]] = Counter()
    for line in corpus_lines():
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(
                backend.normalizer.normalize_str(line)):
            words[(*word[:-1], word[-1] + "</w>")] += 1
    merges = learn_bpe_merges(words, CLIP_MERGES)
    # CLIP's own layout: every byte alone and word-final (so no text is ever unknown), one
    # token per merge in merge order, then the specials.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(alphabet + [a + "</w>" for a in alphabet])}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for special in (CLIP_BOS, CLIP_EOS):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, bos_token=CLIP_BOS, eos_token=CLIP_EOS,
                         unk_token=CLIP_EOS, pad_token=CLIP_EOS, model_max_length=CLIP_CONTEXT)


def clip_text_config(tokenizer: Any) -> dict[str, Any]:
    return {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": CLIP_CONTEXT, **special_token_ids(tokenizer)}


def clip_vision_config() -> dict[str, Any]:
    return {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def clip_image_processor() -> Any:
    # The PIL flavour builds without torchvision; the saved config names the standard
    # CLIPImageProcessor either way, which loads with or without torchvision.
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def build_tiny_clip(outdir: Path) -> Path:
    """Write OUTDIR/tiny-clip: a CLIPModel (text + vision towers) with its CLIPProcessor."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    model_dir = outdir / "tiny-clip"
    tokenizer = train_clip_tokenizer()
    CLIPProcessor(image_processor=clip_image_processor(), tokenizer=tokenizer).save_pretrained(
        model_dir)
    config = CLIPConfig(text_config=clip_text_config(tokenizer),
                        vision_config=clip_vision_config(), projection_dim=32)
    with seeded():
        model = CLIPModel(config).eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def build_tiny_vision(outdir: Path) -> Path:
    """Write OUTDIR/tiny-vision: a LLaVA (CLIP vision tower, projector, tiny Llama) with
    a LlavaProcessor whose chat template places the image token."""
    import transformers as tf

    model_dir = outdir / "tiny-vision"
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(LLM_VOCAB_SIZE), bos_token=BOS, eos_token=EOS,
        pad_token=PAD, model_max_length=2048, extra_special_tokens={"image_token": IMAGE_TOKEN})
    # "default" drops the vision tower's CLS output, so one placeholder per patch.
    tf.LlavaProcessor(image_processor=clip_image_processor(), tokenizer=tokenizer,
                      patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
                      num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
                      chat_template=VISION_CHAT_TEMPLATE).save_pretrained(model_dir)
    token_ids = special_token_ids(tokenizer)
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**clip_vision_config()),
        text_config=llama_config(len(tokenizer), token_ids),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        tie_word_embeddings=True, **token_ids)
    with seeded():
        model = tf.LlavaForConditionalGeneration(config).eval()
    model.generation_config = tf.GenerationConfig(**token_ids)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def build_tiny_sd(outdir: Path) -> Path:
    """Write OUTDIR/tiny-sd: a StableDiffusionPipeline (UNet, VAE, CLIP text encoder and
    tokenizer, Euler scheduler) without safety checker; 64x64 is its native size."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel

    model_dir = outdir / "tiny-sd"
    tokenizer = train_clip_tokenizer()
    with seeded():
        # A two-level VAE scales by 2, so 64x64 images are 32x32 latents; SD's own is 8x.
        vae = diffusers.AutoencoderKL(
            sample_size=64, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
        unet = diffusers.UNet2DConditionModel(
            sample_size=32, block_out_channels=(16, 32), layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
        text_encoder = CLIPTextModel(CLIPTextConfig(**clip_text_config(tokenizer)))
    # Stable Diffusion 1.x's noise schedule.
    scheduler = diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                                 beta_schedule="scaled_linear", steps_offset=1)
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


Builder = Callable[[Path], Path]

BUILDERS: dict[str, Builder] = {
    "tiny-llm": build_tiny_llm,
    "tiny-thinker": build_tiny_thinker,
    "tiny-clip": build_tiny_clip,
    "tiny-vision": build_tiny_vision,
    "tiny-sd": build_tiny_sd,
    "tiny-rerank": lambda outdir: tiny_encoders.build_tiny_rerank(outdir, corpus_lines(),
                                                                  seeded),
}


def _script_digest() -> str:
    # Stored in the marker so that editing a builder invalidates directories built by the
    # old code instead of silently serving stale fixtures.
    sources = b"".join(path.read_bytes() for path in SOURCES)
    return hashlib.sha256(sources).hexdigest()


def is_complete(model_dir: Path) -> bool:
    """True if model_dir was fully built by the current version of this script."""
    marker = model_dir / MARKER_NAME
    return marker.is_file() and marker.read_text(encoding="utf-8").strip() == _script_digest()


def build_model(name: str, outdir: Path) -> Path:
    """Build registered model `name` from scratch under outdir and mark it complete."""
    model_dir = outdir / name
    # Start clean so files from an interrupted or older build cannot linger.
    if model_dir.exists():
        shutil.rmtree(model_dir)
    built_dir = BUILDERS[name](outdir)
    # Written last: its presence means every other file is in place.
    (built_dir / MARKER_NAME).write_text(_script_digest() + "\n", encoding="utf-8")
    return built_dir


def _quiet_transformers() -> None:
    # transformers 5.x draws tqdm bars ("Writing model shards") on save; a fixture
    # generator should only print the paths it wrote.
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("outdir", type=Path, help="directory to write the models into")
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(BUILDERS),
        metavar="NAME",
        help=f"build only this model (repeatable); one of: {', '.join(sorted(BUILDERS))}",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(dict.fromkeys(args.only)) if args.only else list(BUILDERS)
    pending = [n for n in names if args.force or not is_complete(args.outdir / n)]
    # Only import transformers when there is work to do, so up-to-date runs stay instant.
    if pending:
        _quiet_transformers()
    for name in pending:
        print(build_model(name, args.outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
