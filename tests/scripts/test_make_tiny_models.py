"""scripts/make_tiny_models.py must produce a model that loads like a real hub model, offline."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

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
def outdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("tiny")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        assert mtm.main([str(out)]) == 0
    yield out


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
    assert mtm.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(partial)
    assert not (partial / "stale.txt").exists()
    assert (partial / mtm.MARKER_NAME).is_file()

    assert mtm.main([str(tmp_path), "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(partial)
