"""MiniLM through ONNX Runtime: exported once into the cache, checked against eager
PyTorch's vectors at every load, eager again when they differ."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from modelpool.registry.download import resolve_model_dir
from modelpool.registry.loaders import (
    encoder_exec,
    exports_to_make,
    load_model,
    load_model_with_dir,
    onnx_cache,
    onnx_embedding,
    preload_modules,
    weights_size_mb,
)
from modelpool.registry.loaders.onnx_embedding import OnnxEmbedder
from modelpool.registry.loaders.sentence_embedding import SentenceEmbedder
from modelpool.registry.spec import ModelSpec, Registry, load_catalog

TEXTS = ["a worker serves many clients", "short", "the quick brown fox " * 40]


def _minilm(**changes: object) -> ModelSpec:
    spec = Registry(load_catalog()).resolve("minilm")
    assert spec is not None
    return msgspec.structs.replace(spec, **changes)


@pytest.fixture(scope="module")
def cache(minilm_export: None) -> Path:
    """The run's cache, holding MiniLM's export as the daemons' tests use it (made once
    for the run; an export made by a load of "onnx" is tested with tiny-rerank's)."""
    return Path(os.environ["MODELPOOL_CACHE_DIR"])


@pytest.fixture
def in_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="module")
def eager() -> SentenceEmbedder:
    model = load_model(_minilm(execution="eager"))
    assert isinstance(model, SentenceEmbedder)
    return model


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_export_gives_eager_vectors_and_a_later_load_exports_nothing(
        in_cache: Path, eager: SentenceEmbedder, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_export(*_: object) -> None:
        raise AssertionError("exported again")

    monkeypatch.setattr(encoder_exec, "export_in_child", no_export)
    model = load_model(_minilm(execution="onnx"))
    assert isinstance(model, OnnxEmbedder)
    vectors = model.embed(TEXTS)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert _cosines(vectors, eager.embed(TEXTS)).min() >= 0.9999
    info = model.info()
    assert info["execution"] == "onnx" and info["max_seq_length"] == 256
    assert info["execution_reason"].endswith(", fused")  # status says it


def test_auto_without_an_export_serves_eager_at_once_and_names_the_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request does not wait for an export: the daemon makes it in the
    background (supervisor/exports.py) from what the info names."""
    def no_export(*_: object) -> None:
        raise AssertionError("exported at load")

    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(encoder_exec, "export_in_child", no_export)
    model, model_dir = load_model_with_dir(_minilm(execution="auto"))
    assert isinstance(model, SentenceEmbedder) and model_dir is not None
    info = model.info()
    assert info["execution"] == "eager" and "background" in info["execution_reason"]
    assert info["onnx_export"] == {"entry": str(onnx_cache.entry_dir(_minilm(), model_dir)),
                                   "model_dir": str(model_dir)}
    assert list(tmp_path.iterdir()) == []


def test_forced_onnx_in_a_daemons_worker_leaves_the_missing_export_to_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_export(*_: object) -> None:
        raise AssertionError("exported at load")

    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(onnx_cache.EXPORTS_BY_DAEMON_ENV, "1")
    monkeypatch.setattr(encoder_exec, "export_in_child", no_export)
    spec = _minilm(execution="onnx")
    with pytest.raises(onnx_cache.ExportNotMade) as raised:
        load_model(spec)
    model_dir = resolve_model_dir(spec)
    assert model_dir is not None
    assert raised.value.entry == onnx_cache.entry_dir(spec, model_dir)
    assert raised.value.model_dir == model_dir and list(tmp_path.iterdir()) == []


def test_a_daemon_makes_from_its_start_the_exports_its_models_lack(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path))
    spec, forced = _minilm(), _minilm(key="o", execution="onnx")
    others = [_minilm(key="e", execution="eager"), _minilm(key="b", options={"dtype": "bfloat16"})]
    (found, model_dir, entry), (found_forced, _, entry_forced) = exports_to_make(
        [spec, *others, forced])
    assert found == spec and entry == onnx_cache.entry_dir(spec, model_dir)
    assert found_forced == forced and entry_forced == entry  # the same files and options
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(cache))  # where it is made
    assert exports_to_make([spec, forced]) == []


def test_a_hub_model_in_the_hub_cache_is_exported_from_the_start_and_runs_without_torch(
        tmp_path: Path, cache: Path, minilm_in_hub_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(minilm_in_hub_cache))
    hub = _minilm(key="hub", repo="org/minilm", package=None, subdir="")
    model_dir = resolve_model_dir(_minilm())
    assert model_dir is not None
    forced = msgspec.structs.replace(hub, key="forced", execution="onnx")
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path / "empty"))
    found = exports_to_make([hub, forced])
    assert [spec.key for spec, _, _ in found] == ["hub", "forced"]
    assert all(entry == onnx_cache.entry_dir(_minilm(), model_dir) for _, _, entry in found)
    assert "modelpool.workers.preload_torch" in preload_modules([hub])
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(cache))  # where it is made
    assert exports_to_make([hub, forced]) == []
    assert "modelpool.workers.preload_torch" not in preload_modules([hub, forced])


def test_attention_is_exported_plain_and_fused(
        in_cache: Path, eager: SentenceEmbedder) -> None:
    """Traced through eager attention (SDPA's export wraps each layer's softmax in NaN
    handling, which made ONNX Runtime slower), then fused: each layer's attention one
    node, each residual add and its layer norm another. The model is put back after
    tracing."""
    import onnx

    from modelpool.registry.loaders import onnx_export

    model_dir = load_model_with_dir(_minilm(execution="eager"))[1]
    assert model_dir is not None
    entry = onnx_cache.entry_dir(_minilm(), model_dir)
    graph = onnx.load(str(entry / onnx_cache.MODEL_FILE), load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    assert "IsNaN" not in ops and "Softmax" not in ops
    assert ops.count("Attention") == 6  # MiniLM's six layers
    assert ops.count("SkipLayerNormalization") == 12 and "EmbedLayerNormalization" in ops
    before = eager.model.config._attn_implementation
    assert before != "eager"
    with onnx_export._eager_attention(eager.model):
        assert eager.model.config._attn_implementation == "eager"
    assert eager.model.config._attn_implementation == before


def test_a_fused_graph_whose_vectors_differ_is_served_unfused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The fused graph is checked like any export; when its vectors differ, the export
    optimises the plain graph and checks and times that instead."""
    import onnx

    from modelpool.registry.loaders import onnx_export

    verified: list[int] = []
    real_verify = OnnxEmbedder.verify

    def fused_differs(self: OnnxEmbedder) -> float:
        verified.append(len(onnx.load(str(self.entry / onnx_cache.MODEL_FILE),
                                      load_external_data=False).graph.node))
        if len(verified) == 1:
            raise onnx_embedding.VectorsDiffer("fused vectors differ (test)")
        return real_verify(self)

    monkeypatch.setattr(OnnxEmbedder, "verify", fused_differs)
    model_dir = resolve_model_dir(_minilm())
    assert model_dir is not None
    manifest = onnx_export.export_entry(_minilm(), model_dir, tmp_path / "entry")
    ops = [node.op_type for node in onnx.load(
        str(tmp_path / "entry" / onnx_cache.MODEL_FILE), load_external_data=False).graph.node]
    assert manifest.choice == "onnx" and manifest.min_cosine is not None
    assert ops.count("Softmax") == 6 and "Attention" not in ops
    assert verified[0] < verified[1] == len(ops)  # the fused graph first, then the plain
    assert manifest.reason.startswith("timing set in ")
    assert manifest.reason.endswith(
        "; not fused: the fused graph failed its check: fused vectors differ (test)")
    assert "trying the graph unfused" in caplog.text
    assert sorted(path.name for path in (tmp_path / "entry").iterdir()) == [
        "manifest.json", "model.onnx", "model.onnx.data", "reference.npy", "tokenizer.json"]


def test_fusions_that_fail_leave_the_graph_to_be_served_unfused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from modelpool.registry.loaders import onnx_fusion

    (tmp_path / "raw.onnx").write_bytes(b"not a graph")
    why = onnx_fusion.fuse(tmp_path / "raw.onnx", tmp_path / "fused.onnx", None)
    assert why is not None and why.startswith("the fusions failed: DecodeError: ")
    assert "serving the graph unfused" in caplog.text
    assert not (tmp_path / "fused.onnx").exists()


def test_both_runtimes_count_the_tokens_the_model_reads(
        in_cache: Path, eager: SentenceEmbedder) -> None:
    model = load_model(_minilm(execution="onnx"))
    assert isinstance(model, OnnxEmbedder)
    texts = [*TEXTS, "word " * 400]
    counts = model.embed_counted(texts)[1]
    assert counts[1] == 3  # [CLS] short [SEP]
    assert counts[3] == 256  # truncated at max_seq_length, as the model reads it
    assert counts == eager.embed_counted(texts)[1]


def test_the_entry_is_keyed_by_files_and_versions(in_cache: Path) -> None:
    spec = _minilm()
    model_dir = load_model_with_dir(_minilm(execution="eager"))[1]
    assert model_dir is not None
    entry = onnx_cache.entry_dir(spec, model_dir)
    manifest = onnx_cache.read_manifest(entry)
    assert manifest is not None and manifest.min_cosine is not None
    assert manifest.min_cosine >= onnx_embedding.MIN_COSINE
    assert {p.name for p in entry.iterdir()} >= {"model.onnx", "model.onnx.data",
                                                 "tokenizer.json", "reference.npy"}
    other = msgspec.structs.replace(spec, options={"max_seq_length": 128})
    assert onnx_cache.entry_key(other, model_dir) != entry.name


def test_vectors_that_differ_are_never_served(in_cache: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the entry whose reference vectors are not the model's: "onnx" fails the
    load, "auto" runs eager PyTorch and says why."""
    spec = _minilm()
    model_dir = load_model_with_dir(_minilm(execution="eager"))[1]
    assert model_dir is not None
    entry = onnx_cache.entry_dir(spec, model_dir)
    monkeypatch.setenv("MODELPOOL_CACHE_DIR", str(tmp_path))
    copy = onnx_cache.entry_dir(spec, model_dir)
    copy.mkdir(parents=True)
    for path in entry.iterdir():
        (copy / path.name).symlink_to(path)
    (copy / "reference.npy").unlink()
    wrong = np.load(entry / "reference.npy")[:, ::-1].copy()  # the same norms, other vectors
    np.save(copy / "reference.npy", wrong)
    with pytest.raises(onnx_embedding.VectorsDiffer):
        load_model(_minilm(execution="onnx"))
    model = load_model(_minilm(execution="auto"))
    assert isinstance(model, SentenceEmbedder)
    assert model.info()["execution"] == "eager"
    assert "differ" in model.info()["execution_reason"]


def _anonymous_mib() -> float:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return next(int(line.split()[1]) for line in rollup.splitlines()
                if line.startswith("Anonymous:")) / 1024


def test_threads_make_one_session_per_count_and_sessions_map_their_prepacked_weights(
        in_cache: Path) -> None:
    model = load_model(_minilm(execution="onnx"))
    assert isinstance(model, OnnxEmbedder)
    before = model.embed(TEXTS[:1])
    model.set_threads(1)
    assert model.threads == 1 and set(model.sessions) == {1, model.cpus}
    assert np.allclose(model.embed(TEXTS[:1]), before, atol=1e-5)
    # A session that prepacked MiniLM's weights itself took ~42 MiB of private memory;
    # one that maps the layouts saved at export takes its activations only.
    private = _anonymous_mib()
    model.set_threads(model.cpus + 1)
    assert np.allclose(model.embed(TEXTS[:1]), before, atol=1e-5)
    assert _anonymous_mib() - private < 15
    assert len(model.sessions) == len({1, model.cpus, model.cpus + 1})


def test_the_entry_is_made_for_this_kind_of_cpu(in_cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _minilm()
    model_dir = load_model_with_dir(_minilm(execution="eager"))[1]
    assert model_dir is not None
    here = onnx_cache.entry_key(spec, model_dir)
    monkeypatch.setattr(onnx_cache, "cpu_fingerprint", lambda: "another-cpu")
    assert onnx_cache.entry_key(spec, model_dir) != here


def test_a_cached_onnx_model_needs_no_torch_in_the_forkserver(in_cache: Path) -> None:
    assert preload_modules([_minilm()]) == [
        "modelpool.registry.loaders.encoder_exec",
        "modelpool.registry.loaders.onnx_embedding", "onnxruntime", "tokenizers"]
    assert "modelpool.workers.preload_torch" in preload_modules([_minilm(execution="eager")])
    # Its export cached, but run eager: a holder shares torch tensors, a GPU has no ONNX here
    for eager in (_minilm(weights_holder="on"), _minilm(device="cuda"),
                  _minilm(options={"dtype": "float16"})):
        assert "modelpool.workers.preload_torch" in preload_modules([eager]), eager
        assert onnx_cache.cached_choice(eager, resolve_model_dir(eager)) == "eager", eager
    assert onnx_cache.cached_choice(_minilm(), resolve_model_dir(_minilm())) == "onnx"


def test_a_worker_serving_the_export_never_imports_torch(in_cache: Path) -> None:
    code = ("import sys; from modelpool.registry.loaders import load_model; "
            "from modelpool.registry.spec import Registry, load_catalog; "
            "m = load_model(Registry(load_catalog()).resolve('minilm')); "
            "print(m.info()['execution'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ), check=True)
    assert out.stdout.split() == ["onnx", "False"]


def test_the_sessions_threads_use_no_cpu_once_a_pass_has_ended(in_cache: Path) -> None:
    """They spin between the parts of a pass, not after it: an idle worker leaves the
    cores to its siblings. In a process of its own, torch's threads not beside them."""
    code = ("import time; from modelpool.registry.loaders import load_model; "
            "from modelpool.registry.spec import Registry, load_catalog; "
            "m = load_model(Registry(load_catalog()).resolve('minilm')); m.set_threads(2); "
            "[m.embed(['a worker serves many clients %d' % i]) for i in range(30)]; "
            "t = time.process_time(); time.sleep(0.5); print(time.process_time() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ), check=True)
    assert float(out.stdout) < 0.01  # spinning on after the pass: ~0.06 s here


def test_the_export_and_eager_are_timed_in_turns() -> None:
    """The cached choice rests on these timings: a busy spell must not fall on one side."""
    from modelpool.registry.loaders import onnx_export

    calls: list[str] = []
    onnx_export._best_ms(lambda texts: calls.append("e"), lambda texts: calls.append("o"),
                         items=list("abcdef"))
    per_round = 1 + 4  # a batch, then four single inputs
    assert "".join(calls) == "eo" + ("e" * per_round + "o" * per_round) * onnx_export.TIMING_ROUNDS


def test_the_export_peaks_below_the_memory_the_daemon_charges_for_it(tmp_path: Path) -> None:
    """The real export process of the bundled model, its peak resident memory from the
    kernel: the background export is charged onnx_cache.export_peak_mb. Measured from a
    small Python in between: a child's ru_maxrss keeps the size of the process it was
    forked from (this one, models loaded), not only its own after exec."""
    from modelpool.registry.download import resolve_model_dir

    spec = _minilm(key="peak-test")
    model_dir = resolve_model_dir(spec)
    assert model_dir is not None
    weights = weights_size_mb(model_dir)
    assert weights is not None and weights > 80
    argv, payload = onnx_cache.export_command(spec, model_dir, tmp_path / "entry")
    probe = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], "
             "input=sys.stdin.buffer.read(), stdout=subprocess.DEVNULL); print(done.returncode,"
             " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], input=payload,
                          capture_output=True, timeout=onnx_cache.EXPORT_TIMEOUT_S)
    returncode, peak_kb = map(int, done.stdout.split())
    assert returncode == 0 and (tmp_path / "entry" / onnx_cache.MANIFEST).is_file()
    assert 300 < peak_kb / 1024 <= onnx_cache.export_peak_mb(weights), (peak_kb, weights)


def test_a_matryoshka_export_says_its_sizes_as_eager_does(in_cache: Path) -> None:
    """The option is not one that changes the export: the run's entry serves it."""
    model = load_model(_minilm(execution="onnx", options={"matryoshka_dimensions": True}))
    assert isinstance(model, OnnxEmbedder)
    assert model.matryoshka_dimensions == [] and model.info()["matryoshka_dimensions"] == []
    assert "matryoshka_dimensions" not in load_model(_minilm(execution="onnx")).info()
