"""scripts/make_tiny_models.py must produce a model that loads like a real hub model, offline."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_models.py"


def _load_script() -> ModuleType:
    # scripts/ is not a package, so import the file by path.
    spec = importlib.util.spec_from_file_location("make_tiny_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


mtm = _load_script()


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Any attempt to reach the hub must fail loudly instead of silently downloading.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def outdir(tiny_models_dir: Path) -> Path:
    # The session's models, built by main() from this same script (tests/conftest.py):
    # building all of them a second time would only cost time.
    return tiny_models_dir


@pytest.fixture(scope="module")
def llm_dir(outdir: Path) -> Path:
    return outdir / "tiny-llm"


def test_loads_with_auto_classes(llm_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(llm_dir)
    model = AutoModelForCausalLM.from_pretrained(llm_dir, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)

    assert config.architectures == ["LlamaForCausalLM"]
    assert config.max_position_embeddings >= 2048
    assert config.vocab_size == len(tokenizer) == model.get_input_embeddings().num_embeddings
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(config, name) == getattr(tokenizer, name) is not None
        assert getattr(model.generation_config, name) == getattr(tokenizer, name)


def test_directory_is_small(llm_dir: Path) -> None:
    total = sum(f.stat().st_size for f in llm_dir.rglob("*") if f.is_file())
    assert total < 5 * 1024 * 1024
    assert (llm_dir / "model.safetensors").is_file()
    assert (llm_dir / "tokenizer.json").is_file()


def test_tokenizer_round_trips_text(llm_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    for text in ("Once upon a time, there was a tiny model.", "  odd\tspacing ,  é ✓ 42\n"):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_chat_template_renders(llm_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    messages = [{"role": "user", "content": "hello there"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    bare = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert "hello there" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert not bare.endswith("<|im_start|>assistant\n")


def test_forward_pass_shape(llm_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llm_dir, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(llm_dir)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    n = inputs["input_ids"].shape[1]
    assert logits.shape == (1, n, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_build_is_deterministic(tmp_path: Path, llm_dir: Path) -> None:
    rebuilt = mtm.build_tiny_llm(tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (rebuilt / name).read_bytes() == (llm_dir / name).read_bytes(), name


def test_rerun_skips_complete_models_unless_forced(
    tmp_path: Path, outdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = outdir / "tiny-llm" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    capsys.readouterr()
    assert mtm.main([str(outdir), "--only", "tiny-llm"]) == 0
    assert capsys.readouterr().out == ""
    assert weights.stat().st_mtime_ns == before

    # A directory without the marker (e.g. an interrupted build) is rebuilt from scratch.
    partial = tmp_path / "tiny-llm"
    partial.mkdir()
    (partial / "stale.txt").write_text("left over")
    assert mtm.main([str(tmp_path), "--only", "tiny-llm"]) == 0
    assert capsys.readouterr().out.strip() == str(partial)
    assert not (partial / "stale.txt").exists()
    assert (partial / mtm.MARKER_NAME).is_file()

    assert mtm.main([str(tmp_path), "--only", "tiny-llm", "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(partial)


# ---- the multimodal models: tiny-clip, tiny-vision, tiny-sd ----------------------------

MULTIMODAL = ("tiny-clip", "tiny-vision", "tiny-sd")
BEYOND_LLM = (*MULTIMODAL, "tiny-rerank", "tiny-thinker")


def _files(model_dir: Path) -> dict[str, bytes]:
    return {str(f.relative_to(model_dir)): f.read_bytes()
            for f in sorted(model_dir.rglob("*")) if f.is_file() and f.name != mtm.MARKER_NAME}


def _image() -> Any:
    from PIL import Image

    return Image.new("RGB", (48, 40), (30, 120, 200))


@pytest.mark.parametrize("name", BEYOND_LLM)
def test_other_directories_are_small(outdir: Path, name: str) -> None:
    files = _files(outdir / name)
    assert sum(len(data) for data in files.values()) < 5 * 1024 * 1024
    weights = [path for path in files if path.endswith(".safetensors")]
    assert weights and not any(path.endswith((".bin", ".pt", ".pth")) for path in files)


def test_thinkers_tags_are_tokens_decoding_keeps_and_its_prompt_opens_them(
        outdir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(outdir / "tiny-thinker")
    ids = tokenizer.encode("<think>Hm.</think>Yes", add_special_tokens=False)
    assert ids[0] == len(tokenizer) - 2 and len(tokenizer) - 1 in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>Hm.</think>Yes"
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True
                                         ).endswith("<think>\n")


def test_clip_loads_with_auto_classes(outdir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModel, AutoProcessor

    clip_dir = outdir / "tiny-clip"
    config = AutoConfig.from_pretrained(clip_dir)
    model = AutoModel.from_pretrained(clip_dir, use_safetensors=True)
    processor = AutoProcessor.from_pretrained(clip_dir)
    tokenizer = processor.tokenizer
    assert config.architectures == ["CLIPModel"]
    assert type(processor).__name__ == "CLIPProcessor"
    assert type(tokenizer).__name__ == "CLIPTokenizer"
    assert config.text_config.vocab_size == len(tokenizer)
    # Specials last, as in openai/clip-*: the text tower pools at the end-of-text token.
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (len(tokenizer) - 2,
                                                                len(tokenizer) - 1)
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    inputs = processor(text=["a photo of a cat", "rain"], images=[_image()], padding=True,
                       return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    with torch.no_grad():
        out = model(**inputs)
    assert out.logits_per_image.shape == (1, 2)
    assert out.image_embeds.shape[-1] == out.text_embeds.shape[-1] == config.projection_dim


def test_clip_tokenizer_knows_every_text(outdir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(outdir / "tiny-clip")
    ids = tokenizer("Héllo   WORLD ✓ 42, the weather!")["input_ids"]
    # unk is the end-of-text token: it must appear only at the end.
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in ids[1:-1]
    # CLIP lower-cases and squeezes whitespace; the merges learned from the corpus apply.
    assert tokenizer.decode(ids, skip_special_tokens=True) == "héllo world ✓ 4 2 , the weather !"
    assert "the</w>" in tokenizer.convert_ids_to_tokens(ids)


def test_vision_loads_with_auto_classes(outdir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    vision_dir = outdir / "tiny-vision"
    config = AutoConfig.from_pretrained(vision_dir)
    model = AutoModelForImageTextToText.from_pretrained(vision_dir, use_safetensors=True)
    processor = AutoProcessor.from_pretrained(vision_dir)
    assert config.architectures == ["LlavaForConditionalGeneration"]
    assert type(processor).__name__ == "LlavaProcessor"
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What is this?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n") and "<image>" in prompt
    inputs = processor(images=_image(), text=prompt, return_tensors="pt")
    image_slots = int((inputs["input_ids"] == config.image_token_id).sum())
    assert image_slots == config.image_seq_length == 16
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, use_cache=True)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 3)
    tokenizer = processor.tokenizer
    assert config.text_config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id is not None


# diffusers 0.42's Euler scheduler calls np.array() on a tensor, which numpy 2.4 flags.
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept")
def test_sd_loads_with_diffusers(outdir: Path) -> None:
    import torch
    from diffusers import AutoPipelineForText2Image

    pipe = AutoPipelineForText2Image.from_pretrained(outdir / "tiny-sd", use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert pipe.safety_checker is None and pipe.feature_extractor is None
    assert pipe.vae_scale_factor * pipe.unet.config.sample_size == 64
    image = pipe("a cat", num_inference_steps=2, width=64, height=64,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


def test_rerank_scores_query_document_pairs(outdir: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = outdir / "tiny-rerank"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.architectures == ["BertForSequenceClassification"]
    assert model.config.num_labels == 1
    pair = tokenizer("what is a worker", "a worker runs one model")
    assert pair["input_ids"][0] == tokenizer.cls_token_id
    assert pair["input_ids"].count(tokenizer.sep_token_id) == 2
    assert set(pair["token_type_ids"]) == {0, 1}  # the document is segment B
    batch = tokenizer(["q", "q"], ["a worker", "the queue holds requests"], padding=True,
                      return_tensors="pt")
    with torch.inference_mode():
        logits = model(**batch).logits
    assert logits.shape == (2, 1) and abs(float(logits[0] - logits[1])) > 1e-3


def test_other_builds_are_deterministic(tmp_path: Path, outdir: Path) -> None:
    # A fresh process: hash-map order there differs from this one, which once made the
    # tokenizers BPE trainer (with an end-of-word suffix) learn different merges.
    only = [arg for name in BEYOND_LLM for arg in ("--only", name)]
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *only], check=True,
                   capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for name in BEYOND_LLM:
        rebuilt, original = _files(tmp_path / name), _files(outdir / name)
        assert rebuilt.keys() == original.keys(), name
        for path, data in rebuilt.items():
            assert data == original[path], f"{name}/{path}"
