"""Turning untrusted image input into a decoded PIL image, inside the worker only.

Caps on bytes and pixels (a decompression bomb is an error, not a warning), image formats
only, and URL fetching that is off unless configured: http(s) to public addresses only,
every redirect checked again, with size and time limits.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import ipaddress
import mmap
import os
import socket
import ssl
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.pipes import ImagePolicy

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def take_shared(name: str, size: int) -> bytes:
    """The bytes the supervisor put in a POSIX shared-memory segment for us; the segment
    is unlinked at once, so that it outlives no one (the supervisor included)."""
    import _posixshmem  # CPython's binding; SharedMemory would register us to unlink it

    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    try:
        _posixshmem.shm_unlink("/" + name)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            return bytes(view)
    finally:
        os.close(fd)


def open_checked(data: bytes, policy: ImagePolicy) -> Image.Image:
    """The image's header read and checked against the caps; its pixels are decoded
    only when used (load_rgb), so a batch holds few decoded images at a time."""
    if len(data) > policy.max_bytes:
        raise PoolError(ErrorCode.IMAGE_TOO_LARGE,
                        f"image of {len(data)} bytes exceeds {policy.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Exception as exc:  # Pillow raises many types for broken or foreign data
        raise _unreadable(exc) from exc
    if image.width * image.height > policy.max_pixels:
        raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"image of {image.width}x"
                        f"{image.height} pixels exceeds {policy.max_pixels}")
    return image


@dataclass
class OpenedImage:
    """An image whose header has been read and checked; decoded() decodes it."""

    image: Image.Image
    policy: ImagePolicy

    @property
    def pixels(self) -> int:
        return self.image.width * self.image.height

    def decoded(self, working_side: int | None = None) -> Image.Image:
        """The pixels as RGB; with working_side, an image whose shorter side is at least
        twice that is first box-reduced by a whole factor (keeping the shorter side at
        least working_side), so its RGB copy and what a processor makes of it stay
        small."""
        image = self.image
        if working_side and min(image.size) >= 2 * working_side:
            image = _loaded(image, self.policy).reduce(min(image.size) // working_side)
        return load_rgb(image, self.policy)

    def close(self) -> None:
        self.image.close()  # frees the decoded pixels too


def opened(data: list[bytes], policy: ImagePolicy) -> list[OpenedImage]:
    """One request's images, checked per image and in all (max_request_pixels)."""
    images = [OpenedImage(open_checked(d, policy), policy) for d in data]
    pixels = sum(image.pixels for image in images)
    if pixels > policy.max_request_pixels:
        raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"{len(images)} images of {pixels} pixels "
                        f"in all exceed max_request_pixels ({policy.max_request_pixels})")
    return images


def load_rgb(image: Image.Image, policy: ImagePolicy) -> Image.Image:
    """Decode an opened image (bombs are errors, not warnings) as RGB."""
    image = _loaded(image, policy)
    return image if image.mode == "RGB" else image.convert("RGB")


def working_side(info: dict[str, Any]) -> int | None:
    """How large an image the model needs, with room to spare for its own resizing:
    four times its input side, when its loader states one."""
    side = info.get("image_size")
    return 4 * side if isinstance(side, int) and side > 0 else None


def _loaded(image: Image.Image, policy: ImagePolicy) -> Image.Image:
    previous = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = policy.max_pixels
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
            return image
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"image rejected: {exc}") from exc
    except Exception as exc:
        raise _unreadable(exc) from exc
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def decode(data: bytes, policy: ImagePolicy) -> Image.Image:
    return load_rgb(open_checked(data, policy), policy)


def _unreadable(exc: Exception) -> PoolError:
    return PoolError(ErrorCode.BAD_REQUEST, f"not a readable image ({', '.join(FORMATS)}): "
                     f"{type(exc).__name__}: {exc}")


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
        if not routable(address):
            raise PoolError(ErrorCode.URL_NOT_ALLOWED,
                            f"{host} resolves to {address}, which is not a public address")
    return addresses[0]


_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: IPv4 in the low bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # a site's own translator
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated; ::1 and :: among them


def routable(address: str) -> bool:
    """Globally routable unicast, whatever notation maps to it: an IPv6 address that
    carries an IPv4 one (mapped, 6to4, NAT64) is judged by that one; Teredo, a site's
    own NAT64 prefix and the deprecated IPv4-compatible form are refused."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo or ip in _NAT64_LOCAL or ip in _IPV4_COMPATIBLE:
            return False  # tunnels and translators whose far end we cannot judge
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return routable(str(embedded))
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


def _get_once(url: str, policy: ImagePolicy, deadline: float) -> tuple[int, str | None, bytes]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PoolError(ErrorCode.URL_NOT_ALLOWED, f"only http(s) URLs: {url[:100]!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = public_address(parts.hostname, port)
    timeout = max(0.1, deadline - time.monotonic())
    conn = _connection(parts.scheme, parts.hostname, address, port, timeout)
    # The socket timeout bounds each read; a server trickling a byte at a time would
    # hold the fetch for ever, so the connection is cut when the whole fetch is due.
    cutoff: threading.Timer | None = None
    try:
        conn.connect()
        cutoff = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, (conn.sock,))
        cutoff.start()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Host": parts.netloc, "User-Agent": "modelpool"})
        response = conn.getresponse()
        body = response.read(policy.max_bytes + 1)
        if time.monotonic() >= deadline:  # cut off: what was read is not the whole image
            raise _too_slow(url, policy)
        if len(body) > policy.max_bytes:
            raise PoolError(ErrorCode.IMAGE_TOO_LARGE, f"{url} is over {policy.max_bytes} bytes")
        return response.status, response.getheader("Location"), body
    except (OSError, http.client.HTTPException) as exc:
        if time.monotonic() >= deadline:
            raise _too_slow(url, policy) from exc
        raise PoolError(ErrorCode.BAD_REQUEST, f"fetching {url}: {exc}") from exc
    finally:
        if cutoff is not None:
            cutoff.cancel()
        conn.close()


def _too_slow(url: str, policy: ImagePolicy) -> PoolError:
    return PoolError(ErrorCode.BAD_REQUEST, f"fetching {url} took longer than url_timeout_s "
                     f"({policy.url_timeout_s:g}s)")


def _cut(sock: socket.socket) -> None:
    # The response may hold the socket after the connection has let go of it.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


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
