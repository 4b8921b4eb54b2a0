"""Untrusted image input: decoding caps and the URL fetch policy."""

from __future__ import annotations

import contextlib
import http.server
import io
import threading
import time
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


@pytest.mark.parametrize("address", [
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b:1::808:808",  # a site's own NAT64 prefix
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1",  # 6to4 of the metadata service
    "::ffff:127.0.0.1", "::ffff:169.254.169.254",  # IPv4-mapped
    "::7f00:1", "::1", "::",  # IPv4-compatible, loopback, unspecified
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "224.0.0.1", "239.255.255.250", "ff02::1", "ff0e::1",  # multicast
    "100.64.0.1", "240.0.0.1", "255.255.255.255", "fc00::1", "fe80::1",
])
def test_addresses_that_are_not_globally_routable_are_refused(address: str) -> None:
    assert not images.routable(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111",
                                     "64:ff9b::808:808", "2002:808:808::1",
                                     "::ffff:8.8.8.8"])
def test_public_addresses_in_any_notation_pass(address: str) -> None:
    assert images.routable(address)


@pytest.fixture
def trickling_server() -> Iterator[int]:
    """A local server that sends one byte of its reply every 0.3 s, for ever."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            with contextlib.suppress(OSError):
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.3)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_port
    server.shutdown()


def test_url_timeout_bounds_the_whole_fetch(trickling_server: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "public_address", lambda host, port: "127.0.0.1")
    started = time.monotonic()
    with pytest.raises(PoolError) as err:
        images.fetch(f"http://public.test:{trickling_server}/slow.png",
                     ImagePolicy(allow_urls=True, url_timeout_s=1.0))
    took = time.monotonic() - started
    assert err.value.code is ErrorCode.BAD_REQUEST and "url_timeout_s" in err.value.message
    assert took < 2.5, f"the fetch took {took:.1f}s with url_timeout_s = 1"


def test_a_requests_images_are_capped_in_all() -> None:
    policy = ImagePolicy(max_pixels=10_000, max_request_pixels=25_000)
    three = [encoded((100, 100))] * 3
    assert len(images.opened(three[:2], policy)) == 2
    with pytest.raises(PoolError) as err:
        images.opened(three, policy)
    assert err.value.code is ErrorCode.IMAGE_TOO_LARGE
    assert "max_request_pixels" in err.value.message


def test_an_opened_image_is_decoded_only_when_asked() -> None:
    opened = images.opened([encoded((64, 32), "PNG")], ImagePolicy())[0]
    assert opened.pixels == 64 * 32
    assert opened.image.tile  # the header only, so far: the pixels are still to decode
    assert opened.decoded().size == (64, 32)
    assert not opened.image.tile


def test_a_huge_image_is_reduced_to_what_the_model_can_use() -> None:
    opened = images.opened([encoded((2000, 1000))], ImagePolicy())[0]
    assert opened.decoded(working_side=224).size == (500, 250)  # shorter side >= 224
    small = images.opened([encoded((300, 200))], ImagePolicy())[0]
    assert small.decoded(working_side=224).size == (300, 200)  # not twice as large: whole
