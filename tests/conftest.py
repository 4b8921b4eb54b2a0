"""Shared fixtures for the whole suite: the tiny random-weight models, built once."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

# There is no network in CI: any hub access must fail at once instead of hanging. Set
# before anything imports huggingface_hub, and inherited by worker processes.
os.environ["HF_HUB_OFFLINE"] = "1"
# ONNX exports (registry/loaders/onnx_cache.py) go to a directory of this run, not the
# user's cache: the first MiniLM load of a run exports, the others find it.
_ONNX_CACHE = tempfile.TemporaryDirectory(prefix="modelpool-test-cache-")
os.environ["MODELPOOL_CACHE_DIR"] = _ONNX_CACHE.name

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_models.py"


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding every tiny model of scripts/make_tiny_models.py (tiny-llm, ...)."""
    # scripts/ is not a package: import the file by path, without registering it in
    # sys.modules (tests/scripts imports the same file under its own name).
    spec = importlib.util.spec_from_file_location("_modelpool_tiny_models", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    outdir = tmp_path_factory.mktemp("tiny-models")
    assert module.main([str(outdir)]) == 0
    return outdir


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; on machines without it they are skipped, not failed."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
