#!/usr/bin/env python
"""What small hostile inputs cost a worker, and a /dev/shm too small for an image.

Prints one JSON object: for each case, the worker's peak resident memory while it ran
(its VmHWM, reset just before), how long the reply took and what it was:
a 39 KB greyscale PNG of 40 million pixels (under the per-image cap), eight of them in
one request, eight of them in eight requests at once (one batch), an 8 MB text to
embed, an 8 MB prompt; and a daemon whose /dev/shm is a 4 MiB tmpfs asked to embed a
12 MB image (the reply, and whether the daemon and its other clients live on).

    python scripts/adversarial_inputs.py      # ~1 minute on 2 cores (root, for the
                                              # peak reset and the private /dev/shm)
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench import MINILM, Daemon  # noqa: E402

from modelpool.protocol.client import AsyncClient, Client, PoolError  # noqa: E402

MB = 2**20
SMALL_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$@"', "sh"]


def grey_png(side: int = 6324) -> bytes:
    """All-black greyscale: ~39 KB of PNG for 40 million pixels."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (side, side), 0).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def small_png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def worker_pid(c: Client, key: str) -> int:
    model = next(m for m in c.status()["models"] if m["key"] == key)
    return int(next(w["pid"] for w in model["workers"] if w["pid"]))


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS


def peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM")


def outcome(call: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        call()
        result = "ok"
    except PoolError as exc:
        result = f"{exc.code.value}: {exc.message[:120]}"
    return {"reply": result, "seconds": round(time.perf_counter() - t0, 3)}


def measured(c: Client, key: str, call: Any) -> dict[str, Any]:
    pid = worker_pid(c, key)
    reset_peak(pid)
    before = peak_mb(pid)
    figures = outcome(call)
    return {**figures, "worker_rss_before_mb": before, "worker_peak_mb": peak_mb(pid)}


def image_cases(tiny: Path) -> dict[str, Any]:
    daemon = Daemon(f'[pool]\ncold_start_workers = 1\n[[models]]\nkey = "tiny-clip"\n'
                    f'capability = "image_embedding"\npath = "{tiny / "tiny-clip"}"\n')
    png = grey_png()
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket, timeout_s=300) as c:
            c.embed_image(small_png(), model="tiny-clip")
            one = measured(c, "tiny-clip", lambda: c.embed_image(png, model="tiny-clip"))
            eight = measured(c, "tiny-clip",
                             lambda: c.embed_image([png] * 8, model="tiny-clip"))
            pngs = [grey_png(6324 - i) for i in range(8)]  # not identical: not joined
            batched = measured(c, "tiny-clip", lambda: asyncio.run(_eight_at_once(
                daemon.socket, pngs)))
        return {"png_bytes": len(png), "one_grey_png": one, "eight_in_one_request": eight,
                "eight_requests_at_once": batched}
    finally:
        daemon.stop()


async def _eight_at_once(sock: str, pngs: list[bytes]) -> None:
    async with AsyncClient(sock) as c:
        await asyncio.gather(*(c.embed_image(png, model="tiny-clip") for png in pngs))


def text_cases(tiny: Path) -> dict[str, Any]:
    daemon = Daemon(f'[pool]\ncold_start_workers = 1\n[[models]]\nkey = "tiny-llm"\n'
                    f'capability = "text_to_text"\npath = "{tiny / "tiny-llm"}"\n')
    text = "word " * (8 * MB // 5)
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket, timeout_s=300) as c:
            c.embed("warm", model=MINILM)
            list(c.generate("warm", model="tiny-llm", max_tokens=1))
            embed = measured(c, MINILM, lambda: c.embed(text, model=MINILM))
            prompt = measured(c, "tiny-llm",
                              lambda: list(c.generate(text, model="tiny-llm", max_tokens=4)))
        return {"text_bytes": len(text), "embed_8mb_text": embed, "prompt_8mb": prompt}
    finally:
        daemon.stop()


def shm_full(tiny: Path) -> dict[str, Any]:
    daemon = Daemon(f'[pool]\ncold_start_workers = 1\n[[models]]\nkey = "tiny-clip"\n'
                    f'capability = "image_embedding"\npath = "{tiny / "tiny-clip"}"\n',
                    prefix=SMALL_SHM)
    try:
        daemon.wait_listening()
        with Client(socket_path=daemon.socket, timeout_s=120) as c:
            c.embed_image(small_png(), model="tiny-clip")
            big = outcome(lambda: c.embed_image(os.urandom(12 * MB), model="tiny-clip"))
        alive = daemon.process.poll() is None
        after = outcome(lambda: _fresh_embed(daemon.socket)) if alive else None
        return {"shm_mib": 4, "image_mib": 12, "reply": big, "daemon_alive": alive,
                "next_request": after}
    finally:
        if daemon.process.poll() is None:
            daemon.stop()


def _fresh_embed(sock: str) -> None:
    with Client(socket_path=sock, timeout_s=60) as c:
        c.embed_image(small_png(), model="tiny-clip")


def main() -> int:
    if os.geteuid() != 0:
        print("needs root (peak reset, private /dev/shm)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), tmp],
                       check=True, stdout=subprocess.DEVNULL)
        tiny = Path(tmp)
        report = {"images": image_cases(tiny), "texts": text_cases(tiny),
                  "shm_full": shm_full(tiny)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
