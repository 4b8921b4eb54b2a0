"""Untrusted image input: decoding caps and the URL fetch policy."""

from __future__ import annotations

import http.server
import io
import threading
from collections.abc import Iterator

import pytest
from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.pipes import ImagePolicy
from modelpool.workers.capabilities import images


def encoded(size: tuple[int, int], fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (9, 9, 9)).save(buffer, format=fmt)
    return buffer.getvalue()


def code_of(call: object, *args: object) -> ErrorCode:
    with pytest.raises(PoolError) as err:
        call(*args)  # type: ignore[operator]
    return err.value.code


def test_decodes_common_formats_to_rgb() -> None:
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        image = images.decode(encoded((20, 10), fmt), ImagePolicy())
        assert image.mode == "RGB" and image.size == (20, 10)


def test_caps_on_bytes_and_pixels() -> None:
    policy = ImagePolicy(max_bytes=10_000, max_pixels=100 * 100)
    assert code_of(images.decode, b"\x00" * 10_001, policy) is ErrorCode.IMAGE_TOO_LARGE
    assert code_of(images.decode, encoded((101, 100)), policy) is ErrorCode.IMAGE_TOO_LARGE
    assert images.decode(encoded((100, 100)), policy).size == (100, 100)


def test_non_images_and_other_formats_are_bad_requests() -> None:
    assert code_of(images.decode, b"%PDF-1.4 hello", ImagePolicy()) is ErrorCode.BAD_REQUEST
    ico = io.BytesIO()
    Image.new("RGB", (16, 16)).save(ico, format="ICO")  # a real image, not an allowed format
    assert code_of(images.decode, ico.getvalue(), ImagePolicy()) is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/x.png", "http://localhost/x.png", "http://169.254.169.254/latest",
    "http://10.1.2.3/x.png", "http://192.168.0.1/x.png", "http://0.0.0.0/x.png",
    "http://[::1]/x.png", "file:///etc/passwd", "ftp://example.com/x.png",
])
def test_urls_to_non_public_places_are_refused(url: str) -> None:
    policy = ImagePolicy(allow_urls=True)
    assert code_of(images.fetch, url, policy) is ErrorCode.URL_NOT_ALLOWED


def test_urls_are_refused_when_disabled() -> None:
    assert code_of(images.fetch, "https://example.com/a.png",
                   ImagePolicy()) is ErrorCode.URL_NOT_ALLOWED


@pytest.fixture
def redirecting_server() -> Iterator[int]:
    """A local server whose /start redirects to a loopback URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/secret")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_port
    server.shutdown()


def test_each_redirect_is_checked_again(redirecting_server: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real = images.public_address

    def pretend_public(host: str, port: int) -> str:
        # "public.test" stands for a public host that happens to be served locally.
        return "127.0.0.1" if host == "public.test" else real(host, port)

    monkeypatch.setattr(images, "public_address", pretend_public)
    url = f"http://public.test:{redirecting_server}/start"
    with pytest.raises(PoolError) as err:
        images.fetch(url, ImagePolicy(allow_urls=True))
    assert err.value.code is ErrorCode.URL_NOT_ALLOWED and "127.0.0.1" in err.value.message
