"""Small inputs that used to cost a worker gigabytes, and a /dev/shm too small for the
images it is given, against a real daemon."""

from __future__ import annotations

import io
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from adversarial_helpers import model_entry, running_daemon, start_daemon
from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.pipes import SHM_DIR

SMALL_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$@"', "sh"]
MB = 2**20


def png(size: tuple[int, int] = (32, 32), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def clip_config(tiny_models_dir: Path) -> str:
    return f"""
        [pool]
        cold_start_workers = 1
        [[models]]
        key = "tiny-clip"
        capability = "image_embedding"
        path = "{tiny_models_dir / "tiny-clip"}"
    """


def worker_of(client: object, key: str) -> psutil.Process:
    status = client.status()  # type: ignore[attr-defined]
    model = next(m for m in status["models"] if m["key"] == key)
    return psutil.Process(next(w["pid"] for w in model["workers"] if w["pid"]))


def peak_mb_during(worker: psutil.Process, call: object) -> float:
    """How far the worker's peak RSS rose above its RSS while call() ran."""
    Path(f"/proc/{worker.pid}/clear_refs").write_text("5")  # reset the peak
    before = worker.memory_info().rss
    call()  # type: ignore[operator]
    peak = int(next(line.split()[1] for line in
                    Path(f"/proc/{worker.pid}/status").read_text().splitlines()
                    if line.startswith("VmHWM:"))) * 1024
    return (peak - before) / MB


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private /dev/shm needs root and unshare")
def test_a_full_dev_shm_fails_only_that_request(tmp_path: Path,
                                                tiny_models_dir: Path) -> None:
    daemon = start_daemon(tmp_path, clip_config(tiny_models_dir), prefix=SMALL_SHM)
    try:
        with daemon.client() as c:
            c.embed_image(png(), model="tiny-clip")
            with pytest.raises(PoolError) as refused:
                c.embed_image(os.urandom(12 * MB), model="tiny-clip")  # 4 MiB of /dev/shm
            assert refused.value.code is ErrorCode.OVERLOADED
            assert "no room in /dev/shm" in refused.value.message
            assert c.embed_image(png((8, 8)), model="tiny-clip").shape == (32,)
        assert daemon.process.poll() is None
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_killed_daemon_leaves_no_image_segment_behind(tmp_path: Path) -> None:
    config = model_entry("slowimg", "slow_image_embedder", "image_embedding", run_s=30)
    daemon = start_daemon(tmp_path, "[pool]\ncold_start_workers = 1\n" + config)
    workers = []
    try:
        def ask() -> None:
            try:
                with daemon.client() as c:
                    c.embed_image(png(), model="slowimg")
            except PoolError:
                pass  # the daemon is killed under it
        threading.Thread(target=ask, daemon=True).start()
        with daemon.client() as c:
            deadline = time.monotonic() + 30
            while not any(m["running"] for m in c.status()["models"] if m["key"] == "slowimg"):
                assert time.monotonic() < deadline, "the image request never ran"
                time.sleep(0.05)
            time.sleep(0.2)  # the worker has the image
        workers = daemon.descendants()
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(10)
        left = list(SHM_DIR.glob(f"modelpool-{daemon.process.pid}-*"))
        assert left == []
    finally:
        for worker in workers:
            worker.kill()


def test_small_hostile_inputs_cost_a_worker_little(tmp_path: Path,
                                                   tiny_models_dir: Path) -> None:
    grey = png((6324, 6324), "L")  # ~39 KB for 40 million pixels, under the per-image cap
    assert len(grey) < 100_000
    text = "word " * (8 * MB // 5)
    with running_daemon(tmp_path, clip_config(tiny_models_dir) + f"""
        [[models]]
        key = "tiny-llm"
        capability = "text_to_text"
        path = "{tiny_models_dir / "tiny-llm"}"
    """) as daemon, daemon.client(timeout_s=120) as c:
        c.embed_image(png(), model="tiny-clip")
        c.embed("warm")
        list(c.generate("warm", model="tiny-llm", max_tokens=1))
        clip = worker_of(c, "tiny-clip")
        assert peak_mb_during(clip, lambda: c.embed_image(grey, model="tiny-clip")) < 200
        with pytest.raises(PoolError) as too_many:
            c.embed_image([grey] * 8, model="tiny-clip")
        assert too_many.value.code is ErrorCode.IMAGE_TOO_LARGE
        minilm = worker_of(c, "sentence-transformers/all-MiniLM-L6-v2")
        started = time.monotonic()
        assert peak_mb_during(minilm, lambda: c.embed(text)) < 200
        assert time.monotonic() - started < 3
        llm = worker_of(c, "tiny-llm")
        with pytest.raises(PoolError) as refused:
            peak_mb_during(llm, lambda: list(c.generate(text, model="tiny-llm")))
        assert refused.value.code is ErrorCode.BAD_REQUEST
        assert "context" in refused.value.message
