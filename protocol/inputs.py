"""What a client may hand over as an image, turned into the wire's ImageInput.

Read here, in the client: the daemon never opens a client's paths. URLs go as URLs (the
daemon fetches them only when its config allows).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from typing import Any

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.messages import ImageInput

ImageLike = Any  # a path, bytes, a PIL image, a base64 string, or an http(s) URL


def image_input(image: ImageLike) -> ImageInput:
    if isinstance(image, ImageInput):  # already what travels
        return image
    if isinstance(image, bytes | bytearray | memoryview):
        return ImageInput(data=bytes(image))
    if isinstance(image, os.PathLike):
        return ImageInput(data=_read(Path(image)))
    if isinstance(image, str):
        if image.startswith(("http://", "https://")):
            return ImageInput(url=image)
        if len(image) < 4096 and os.path.isfile(image):
            return ImageInput(data=_read(Path(image)))
        encoded = image.split(",", 1)[1] if image.startswith("data:") else image
        try:
            return ImageInput(data=base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            raise PoolError(ErrorCode.BAD_REQUEST, _not_an_image(image)) from None
    if hasattr(image, "save"):  # a PIL image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return ImageInput(data=buffer.getvalue())
    raise PoolError(ErrorCode.BAD_REQUEST, f"cannot send a {type(image).__name__} as an image")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PoolError(ErrorCode.BAD_REQUEST, f"cannot read image {str(path)!r}: "
                        f"{exc.strerror or exc}") from None


def _not_an_image(image: str) -> str:
    """A string that is neither a file nor base64: most likely a path with a typo."""
    if len(image) < 4096 and (os.sep in image or "." in image[-6:]):
        return f"image {image!r}: no such file"
    return (f"image {image[:60]!r}{'...' if len(image) > 60 else ''}: no such file, and "
            f"not an http(s) URL or base64")
