"""What Client and AsyncClient share: reply types, input conversion, message builders."""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.framing import MAX_FRAME_BYTES
from modelpool.protocol.messages import (
    Ack,
    ChatMessage,
    Chunk,
    Describe,
    Embed,
    Embeddings,
    EmbedImage,
    End,
    Error,
    Generate,
    GenerateImage,
    ImageInput,
    ImageProgress,
    ModelsReply,
    Priority,
    StatusReply,
    Welcome,
    encoder,
)
from modelpool.protocol.messages import Image as ImageMsg

FINAL = (Embeddings, End, Error, StatusReply, ModelsReply, Ack, ImageMsg)


@dataclass(frozen=True)
class TextChunk:
    text: str
    finish_reason: str | None = None  # set on the last chunk only
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class ImageChunk:
    """Progress of generate_image; the last chunk carries the finished image in .png."""

    step: int
    total_steps: int
    preview_png: bytes | None = None
    png: bytes | None = None
    width: int | None = None
    height: int | None = None
    seed: int | None = None


ImageLike = Any  # a path, bytes, a PIL image, a base64 string, or an http(s) URL


def image_input(image: ImageLike) -> ImageInput:
    """Read what the caller has into bytes here, in the client: the daemon never opens
    a client's paths. URLs go as URLs (the daemon fetches them only if configured to)."""
    if isinstance(image, bytes | bytearray | memoryview):
        return ImageInput(data=bytes(image))
    if isinstance(image, os.PathLike):
        return ImageInput(data=Path(image).read_bytes())
    if isinstance(image, str):
        if image.startswith(("http://", "https://")):
            return ImageInput(url=image)
        if len(image) < 4096 and os.path.isfile(image):
            return ImageInput(data=Path(image).read_bytes())
        encoded = image.split(",", 1)[1] if image.startswith("data:") else image
        try:
            return ImageInput(data=base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            raise PoolError(ErrorCode.BAD_REQUEST, "image string is not a file, an http(s) "
                            "URL or base64") from None
    if hasattr(image, "save"):  # a PIL image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return ImageInput(data=buffer.getvalue())
    raise PoolError(ErrorCode.BAD_REQUEST, f"cannot send a {type(image).__name__} as an image")


def image_chunk(msg: Any) -> ImageChunk:
    msg = check_reply(msg)
    if isinstance(msg, ImageProgress):
        return ImageChunk(step=msg.step, total_steps=msg.total_steps,
                          preview_png=msg.preview_png)
    return ImageChunk(step=-1, total_steps=-1, png=msg.png, width=msg.width,
                      height=msg.height, seed=msg.seed)


def embed_msg(rid: int, texts: str | list[str], model: str | None, **opts: Any) -> Embed:
    return Embed(id=rid, model=model or "", texts=[texts] if isinstance(texts, str) else texts,
                 **opts)


def generate_msg(rid: int, prompt: str | list[dict[str, str]], model: str | None,
                  **opts: Any) -> Generate:
    if isinstance(prompt, str):
        return Generate(id=rid, model=model or "", prompt=prompt, **opts)
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in prompt]
    return Generate(id=rid, model=model or "", messages=messages, **opts)


def check_reply(msg: Any) -> Any:
    if isinstance(msg, Error):
        raise PoolError(msg.code, msg.message, msg.retry_after_s)
    return msg


def vectors_of(msg: Any, single: bool) -> np.ndarray:
    reply: Embeddings = check_reply(msg)
    array = np.frombuffer(reply.data, dtype=np.dtype(reply.dtype).newbyteorder("<"))
    array = array.reshape(reply.shape)
    return array[0] if single else array


def text_chunk(msg: Any) -> TextChunk:
    msg = check_reply(msg)
    if isinstance(msg, Chunk):
        return TextChunk(text=msg.text)
    return TextChunk(text="", finish_reason=msg.finish_reason, prompt_tokens=msg.prompt_tokens,
                     completion_tokens=msg.completion_tokens)


def is_last(chunk: TextChunk | ImageChunk) -> bool:
    if isinstance(chunk, ImageChunk):
        return chunk.png is not None
    return chunk.finish_reason is not None


def request_options(priority: Priority, timeout_s: float | None, deadline_s: float | None) -> dict:
    # sent_at lets the daemon count a deadline from when the request left the client.
    return {"priority": priority, "timeout_s": timeout_s, "deadline_s": deadline_s,
            "sent_at": time.time() if deadline_s is not None else None}


def encode_checked(msg: msgspec.Struct, welcome: Welcome | None) -> bytes:
    """Encode, refusing locally what the daemon would refuse as too large."""
    payload = encoder.encode(msg)
    limit = welcome.max_frame_bytes if welcome else MAX_FRAME_BYTES
    if len(payload) > limit:
        raise PoolError(ErrorCode.BAD_REQUEST,
                        f"request of {len(payload)} bytes exceeds the daemon's limit of {limit}")
    return payload


def undecodable(exc: Exception) -> PoolError:
    """A reply this client cannot read: most likely a daemon of a newer version."""
    return PoolError(ErrorCode.PROTOCOL_VERSION, f"cannot decode the daemon's reply ({exc}); "
                     "is the client older than the daemon?")


def unavailable(path: str, exc: BaseException) -> PoolError:
    return PoolError(ErrorCode.UNAVAILABLE, f"cannot reach the modelpool daemon at {path}: "
                     f"{exc} (is `modelpool serve` running?)")


def embed_image_msg(rid: int, images: ImageLike | list[ImageLike], model: str | None,
                    **opts: Any) -> tuple[EmbedImage, bool]:
    """The request, and whether the caller gave one image (a (dim,) result) or a list."""
    single = not isinstance(images, list)
    items = [image_input(i) for i in ([images] if single else images)]
    return EmbedImage(id=rid, model=model or "", images=items, **opts), single


def describe_msg(rid: int, image: ImageLike, query: str, model: str | None,
                 stop: list[str] | None, **opts: Any) -> Describe:
    return Describe(id=rid, model=model or "", image=image_input(image), prompt=query,
                    stop=stop or [], **opts)


def generate_image_msg(rid: int, prompt: str, model: str | None, **opts: Any) -> GenerateImage:
    return GenerateImage(id=rid, model=model or "", prompt=prompt, **opts)
