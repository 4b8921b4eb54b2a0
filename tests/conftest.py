"""Shared fixtures for the whole suite: the tiny random-weight models, built once."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

# There is no network in CI: any hub access must fail at once instead of hanging. Set
# before anything imports huggingface_hub, and inherited by worker processes.
os.environ["HF_HUB_OFFLINE"] = "1"
# ONNX exports (registry/loaders/onnx_cache.py) go to a directory of this run, not the
# user's cache: made once per run (the minilm_export fixture), found by the rest.
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


@pytest.fixture(scope="module")
def llm(tiny_models_dir: Path) -> Any:
    """tiny-llm loaded by its real loader (a CausalLM), once per test module."""
    from modelpool.registry.loaders import load_model
    from modelpool.registry.loaders.causal_lm import CausalLM
    from modelpool.registry.spec import ModelSpec

    model = load_model(ModelSpec(key="tiny-llm", capability="text_to_text",
                                 path=str(tiny_models_dir / "tiny-llm")))
    assert isinstance(model, CausalLM)
    return model


# Makes each export given (payloads: onnx_cache.export_payload) in one process.
_EXPORT_ALL = """
import sys, msgspec
from modelpool.registry.loaders.onnx_export import export_from_payload
for payload in msgspec.msgpack.decode(sys.stdin.buffer.read()):
    export_from_payload(payload)
"""


@pytest.fixture(scope="session")
def _run_exports(tiny_models_dir: Path) -> None:
    """The run's exports of MiniLM and tiny-rerank (as the tests' daemons configure it:
    no options), made once, in one process: its imports (torch, the exporter) took ~10 s
    here, once for both."""
    from modelpool.registry.download import resolve_model_dir
    from modelpool.registry.loaders import onnx_cache
    from modelpool.registry.spec import ModelSpec, Registry, load_catalog

    minilm = Registry(load_catalog()).resolve("minilm")
    assert minilm is not None
    minilm_dir = resolve_model_dir(minilm)
    assert minilm_dir is not None
    rerank_dir = tiny_models_dir / "tiny-rerank"
    rerank = ModelSpec(key="tiny-rerank", capability="rerank", path=str(rerank_dir))
    payloads = [onnx_cache.export_payload(spec, model_dir, entry)
                for spec, model_dir in ((minilm, minilm_dir), (rerank, rerank_dir))
                if onnx_cache.read_manifest(entry := onnx_cache.entry_dir(spec, model_dir))
                is None]
    if payloads:
        done = subprocess.run([sys.executable, "-I", "-c", _EXPORT_ALL],
                              input=msgspec.msgpack.encode(payloads), capture_output=True,
                              timeout=onnx_cache.EXPORT_TIMEOUT_S)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]


@pytest.fixture(scope="session")
def minilm_export(_run_exports: None) -> None:
    """The run's MiniLM export, made once before a test daemon needs it. A daemon without
    it serves eager PyTorch, makes the export in the background and then replaces its
    workers (tests/integration/test_onnx_background.py); the other tests want the
    steady state from their first request, and one export per run, not one per daemon."""


@pytest.fixture(scope="session")
def tiny_rerank_export(_run_exports: None) -> None:
    """The run's tiny-rerank export, made once, for the same reasons as MiniLM's. A
    daemon fixture that serves tiny-rerank asks for it: it starts before any autouse
    fixture of its tests."""


@pytest.fixture(scope="session")
def put_minilm_in_hub_cache() -> Callable[[Path], None]:
    """put(hub): the bundled MiniLM into the hub cache at hub, as the hub repo
    org/minilm. Its snapshot's files link to the package's, as huggingface_hub links them
    to its blobs: the same files, so the same ONNX cache entry."""
    from modelpool.registry.download import resolve_model_dir
    from modelpool.registry.spec import Registry, load_catalog

    spec = Registry(load_catalog()).resolve("minilm")
    assert spec is not None
    model_dir = resolve_model_dir(spec)
    assert model_dir is not None
    commit = "0123456789abcdef0123456789abcdef01234567"

    def put(hub: Path) -> None:
        folder = hub / "models--org--minilm"
        for path in model_dir.rglob("*"):
            if path.is_file():
                link = folder / "snapshots" / commit / path.relative_to(model_dir)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(path)
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(commit)

    return put


@pytest.fixture
def minilm_in_hub_cache(tmp_path: Path, put_minilm_in_hub_cache: Callable[[Path], None]
                        ) -> Path:
    """A hub cache (its directory) holding the bundled MiniLM as the hub repo org/minilm."""
    put_minilm_in_hub_cache(tmp_path / "hub")
    return tmp_path / "hub"


@pytest.fixture
def hold_minilm_export(monkeypatch: pytest.MonkeyPatch
                       ) -> Callable[..., contextlib.AbstractContextManager[None]]:
    """with hold(cache): holds the lock MiniLM's export takes on its entry in that ONNX
    cache (and points this process at it), so that an export waits and a daemon's
    first workers are sure to find none. With found_made, the run's export is linked
    into that cache as the hold ends: the export that waited finds it made, as one
    finds another process's, instead of making it again (~10 s of a test about waiting)."""
    from modelpool.registry.download import resolve_model_dir
    from modelpool.registry.loaders import onnx_cache
    from modelpool.registry.spec import Registry, load_catalog

    @contextlib.contextmanager
    def hold(cache: Path, *, found_made: bool = False) -> Iterator[None]:
        spec = Registry(load_catalog()).resolve("minilm")
        assert spec is not None
        model_dir = resolve_model_dir(spec)
        assert model_dir is not None
        made = onnx_cache.entry_dir(spec, model_dir)  # the run's: minilm_export made it
        monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(cache))
        entry = onnx_cache.entry_dir(spec, model_dir)
        entry.parent.mkdir(parents=True)
        with open(entry.parent / f"{entry.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
            if found_made:
                entry.symlink_to(made)

    return hold


DAEMON_TEST_DIRS = ("adversarial", "cluster", "integration")


@pytest.fixture(autouse=True)
def _minilm_exported(request: pytest.FixtureRequest) -> None:
    """Tests that start daemons start them with MiniLM's export cached."""
    if request.node.path.parent.name in DAEMON_TEST_DIRS:
        request.getfixturevalue("minilm_export")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA; on machines without it they are skipped, not failed."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
