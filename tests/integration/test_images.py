"""The three image capabilities through a real daemon: tiny CLIP, LLaVA and Stable
Diffusion models built locally, the client's input forms, streams, cancels, hostile input."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Daemon, start_daemon
from PIL import Image

from modelpool.protocol.client import AsyncClient, PoolError
from modelpool.protocol.errors import ErrorCode
from modelpool.supervisor.shm import segment_prefix


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[Daemon]:
    daemon = start_daemon(tmp_path_factory.mktemp("images"), f"""
        [images]
        max_bytes = 300000
        max_pixels = 1000000
        [[models]]
        key = "tiny-clip"
        capability = "image_embedding"
        path = "{tiny_models_dir / 'tiny-clip'}"
        [[models]]
        key = "tiny-vision"
        capability = "vision"
        path = "{tiny_models_dir / 'tiny-vision'}"
        [[models]]
        key = "tiny-sd"
        capability = "text_to_image"
        path = "{tiny_models_dir / 'tiny-sd'}"
    """)
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_embedding_is_the_same_for_every_input_form(
        daemon: Daemon, tmp_path: Path, tiny_models_dir: Path) -> None:
    data = png((200, 30, 90))
    path = tmp_path / "red.png"
    path.write_bytes(data)
    with daemon.client() as c:
        forms = [c.embed_image(x, model="tiny-clip") for x in
                 (str(path), path, data, base64.b64encode(data).decode(),
                  Image.open(io.BytesIO(data)))]
        both = c.embed_image([data, png((0, 0, 255))], model="tiny-clip")
        text = c.embed("a red square", model="tiny-clip")
    for vector in forms[1:]:
        np.testing.assert_array_equal(vector, forms[0])
    assert both.shape == (2, forms[0].shape[0]) and text.shape == forms[0].shape
    np.testing.assert_allclose(both[0], forms[0], atol=1e-6)
    from modelpool.registry.loaders import load_model
    from modelpool.registry.spec import ModelSpec

    local = load_model(ModelSpec(key="c", capability="image_embedding",
                                 path=str(tiny_models_dir / "tiny-clip")))
    expected = local.embed_images([Image.open(io.BytesIO(data)).convert("RGB")])[0]
    np.testing.assert_allclose(forms[0], expected, atol=1e-5)


def test_concurrent_image_embeddings(daemon: Daemon) -> None:
    colors = [(i * 15, 255 - i * 15, 100) for i in range(16)]

    async def run() -> list[np.ndarray]:
        async with AsyncClient(daemon.socket_path) as c:
            return await asyncio.gather(*(c.embed_image(png(col), model="tiny-clip")
                                          for col in colors))

    got = asyncio.run(run())
    with daemon.client() as c:
        expected = c.embed_image([png(col) for col in colors], model="tiny-clip")
    np.testing.assert_allclose(np.stack(got), expected, atol=1e-5)


def test_describe_streams_then_ends_and_cancels(daemon: Daemon) -> None:
    image = png((10, 200, 10))
    with daemon.client() as c:
        chunks = list(c.describe(image, "what is this?", model="tiny-vision", max_tokens=8,
                                 ignore_eos=True, seed=1))
        again = "".join(ch.text for ch in c.describe(image, "what is this?", model="tiny-vision",
                                                     max_tokens=8, ignore_eos=True, seed=1))
        assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 8
        assert "".join(ch.text for ch in chunks) == again
        for _ in c.describe(image, model="tiny-vision", max_tokens=100_000, ignore_eos=True):
            break  # cancel mid-stream
        after = list(c.describe(image, model="tiny-vision", max_tokens=3, ignore_eos=True))
        assert after[-1].completion_tokens == 3


def test_generate_image_is_reproducible_and_streams_each_step(daemon: Daemon) -> None:
    with daemon.client() as c:
        first = list(c.generate_image("a cat", model="tiny-sd", steps=4, width=64, height=64,
                                      seed=5, preview_every=2))
        second = list(c.generate_image("a cat", model="tiny-sd", steps=4, width=64,
                                       height=64, seed=5))
        other = list(c.generate_image("a cat", model="tiny-sd", steps=4, width=64, height=64,
                                      seed=6))
        for chunk in c.generate_image("a cat", model="tiny-sd", steps=500, width=64,
                                      height=64):
            assert chunk.step == 1
            break  # cancel mid-way; the worker stops between steps
        quick = list(c.generate_image("a dog", model="tiny-sd", steps=2, width=64, height=64))
    progress = first[:-1]
    assert [p.step for p in progress] == [1, 2, 3, 4] and progress[0].total_steps == 4
    assert [p.preview_png is not None for p in progress] == [False, True, False, True]
    final = first[-1]
    assert final.png is not None and (final.width, final.height, final.seed) == (64, 64, 5)
    assert Image.open(io.BytesIO(final.png)).size == (64, 64)
    assert second[-1].png == final.png and other[-1].png != final.png
    assert quick[-1].png is not None


@pytest.mark.parametrize(("image", "code"), [
    (b"this is not an image", ErrorCode.BAD_REQUEST),
    (os.urandom(400_000), ErrorCode.IMAGE_TOO_LARGE),  # over max_bytes: refused at once
    ("http://example.com/cat.png", ErrorCode.URL_NOT_ALLOWED),  # URLs are off by default
])
def test_bad_images_get_typed_errors(daemon: Daemon, image: object, code: ErrorCode) -> None:
    with daemon.client() as c, pytest.raises(PoolError) as err:
        c.embed_image(image, model="tiny-clip")
    assert err.value.code is code


def test_a_decompression_bomb_is_refused_and_the_worker_lives(daemon: Daemon) -> None:
    bomb = png((0, 0, 0), size=(2000, 2000))  # tiny file, 4 MP > max_pixels (1 MP)
    assert len(bomb) < 300_000
    with daemon.client() as c:
        c.embed_image(png((1, 2, 3)), model="tiny-clip")
        pids = {w["pid"] for m in c.status()["models"] if m["key"] == "tiny-clip"
                for w in m["workers"]}
        for _ in range(3):
            with pytest.raises(PoolError) as err:
                c.embed_image(bomb, model="tiny-clip")
            assert err.value.code is ErrorCode.IMAGE_TOO_LARGE
        with pytest.raises(PoolError) as err:
            list(c.describe(bomb, model="tiny-vision"))
        assert err.value.code is ErrorCode.IMAGE_TOO_LARGE
        assert c.embed_image(png((3, 2, 1)), model="tiny-clip").ndim == 1
        after = {w["pid"] for m in c.status()["models"] if m["key"] == "tiny-clip"
                 for w in m["workers"]}
    assert after == pids  # nobody died


def test_shared_memory_is_back_at_baseline_after_1000_images(daemon: Daemon) -> None:
    def ours() -> set[str]:  # this daemon's segments, not a concurrent test's daemon's
        prefix = segment_prefix(daemon.process.pid)
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}

    before = ours()
    images = [png((i % 256, (i * 7) % 256, (i * 13) % 256), size=(16, 16)) for i in range(1000)]

    async def run() -> None:
        async with AsyncClient(daemon.socket_path) as c:
            for start in range(0, 1000, 50):
                await asyncio.gather(*(c.embed_image(img, model="tiny-clip")
                                       for img in images[start : start + 50]))

    asyncio.run(run())
    assert ours() <= before
