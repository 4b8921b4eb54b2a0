"""Turning untrusted image input into a decoded PIL image, inside the worker only.

Caps on bytes and pixels (a decompression bomb is an error, not a warning), image formats
only, and URL fetching that is off unless configured: http(s) to public addresses only,
every redirect checked again, with size and time limits.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import mmap
import os
import socket
import ssl
import time
import urllib.parse
import warnings

from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.pipes import ImagePolicy

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def read_shared(name: str, size: int) -> bytes:
    """The bytes the supervisor put in a POSIX shared-memory segment for us."""
    import _posixshmem  # CPython's binding; SharedMemory would register us to unlink it

    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            return bytes(view)
    finally:
        os.close(fd)


def decode(data: bytes, policy: ImagePolicy) -> Image.Image:
    if len(data) > policy.max_bytes:
        raise PoolError(ErrorCode.IMAGE_TOO_LARGE,
                        f"image of {len(data)} bytes exceeds {policy.max_bytes}")
    previous = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = policy.max_pixels
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            if image.width * image.height > policy.max_pixels:
                raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"image of {image.width}x"
                                f"{image.height} pixels exceeds {policy.max_pixels}")
            image.load()
    except PoolError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"image rejected: {exc}") from exc
    except Exception as exc:  # Pillow raises many types for broken or foreign data
        raise PoolError(ErrorCode.BAD_REQUEST, f"not a readable image ({', '.join(FORMATS)}):"
                        f" {type(exc).__name__}: {exc}") from exc
    finally:
        Image.MAX_IMAGE_PIXELS = previous
    return image.convert("RGB")


def fetch(url: str, policy: ImagePolicy) -> bytes:
    if not policy.allow_urls:
        raise PoolError(ErrorCode.URL_NOT_ALLOWED,
                        "image URLs are disabled (set [images] allow_urls = true)")
    deadline = time.monotonic() + policy.url_timeout_s
    for _ in range(policy.url_max_redirects + 1):
        status, location, body = _get_once(url, policy, deadline)
        if status in (301, 302, 303, 307, 308) and location:
            url = urllib.parse.urljoin(url, location)  # checked again on the next turn
            continue
        if status != 200:
            raise PoolError(ErrorCode.BAD_REQUEST, f"fetching {url}: HTTP {status}")
        return body
    raise PoolError(ErrorCode.URL_NOT_ALLOWED, f"more than {policy.url_max_redirects} redirects")


def public_address(host: str, port: int) -> str:
    """An address of host that is public; refuses hosts resolving to anything else (so a
    URL cannot reach loopback, the link-local metadata service or a private network)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PoolError(ErrorCode.URL_NOT_ALLOWED, f"cannot resolve {host}: {exc}") from exc
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        if not ipaddress.ip_address(address.split("%")[0]).is_global:
            raise PoolError(ErrorCode.URL_NOT_ALLOWED,
                            f"{host} resolves to {address}, which is not a public address")
    return addresses[0]


def _get_once(url: str, policy: ImagePolicy, deadline: float) -> tuple[int, str | None, bytes]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PoolError(ErrorCode.URL_NOT_ALLOWED, f"only http(s) URLs: {url[:100]!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = public_address(parts.hostname, port)
    timeout = max(0.1, deadline - time.monotonic())
    conn = _connection(parts.scheme, parts.hostname, address, port, timeout)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Host": parts.netloc, "User-Agent": "modelpool"})
        response = conn.getresponse()
        body = response.read(policy.max_bytes + 1)
        if len(body) > policy.max_bytes:
            raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"{url} is over {policy.max_bytes} bytes")
        return response.status, response.getheader("Location"), body
    except (OSError, http.client.HTTPException) as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, f"fetching {url}: {exc}") from exc
    finally:
        conn.close()


def _connection(scheme: str, host: str, address: str, port: int,
                timeout: float) -> http.client.HTTPConnection:
    """A connection to the address we checked, not to whatever host resolves to next."""
    if scheme == "http":
        conn = http.client.HTTPConnection(address, port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(address, port, timeout=timeout,
                                           context=_TlsFor(host))
    return conn


class _TlsFor(ssl.SSLContext):
    """Verifies the certificate against the URL's host while connecting to its address."""

    def __new__(cls, host: str) -> _TlsFor:
        ctx = super().__new__(cls, ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_default_certs()
        ctx.host = host  # type: ignore[attr-defined]
        return ctx

    def wrap_socket(self, sock: socket.socket, *args: object, **kwargs: object) -> ssl.SSLSocket:
        kwargs["server_hostname"] = self.host  # type: ignore[attr-defined]
        return super().wrap_socket(sock, *args, **kwargs)  # type: ignore[arg-type]
