"""The HTTP API's request bodies (OpenAI's shapes, and our extensions) and what each
asks of the pool: an operation of the one table of request kinds and its arguments.

Unknown fields are ignored, as OpenAI-compatible servers do. OpenAI's fields that would
change the answer if silently dropped (`functions`, `modalities`, ...) are
declared, and refused by name unless they ask for nothing: each body's `refused`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.protocol.fields import (
    IMAGE_SIDE_MAX,
    IMAGE_SIDE_MIN,
    IMAGE_SIDE_STEP,
    MAX_TOKENS,
    TOP_K_MAX,
    LogitBias,
    Penalty,
    Priority,
    RepetitionPenalty,
    Steps,
    Stops,
    StopTokenIds,
    TokenId,
    TopLogprobs,
)
from modelpool.protocol.messages import Effort, ImageInput
from modelpool.supervisor.httpapi.structured import (
    GuidedChoice,
    ResponseFormat,
    Schema,
    StructuredOutputs,
    language,
)
from modelpool.supervisor.httpapi.tools import (
    MessageToolCall,
    ToolCalls,
    ToolChoice,
    Tools,
)

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
Texts = Annotated[list[str], msgspec.Meta(min_length=1)]
ImageUrlText = Annotated[str, msgspec.Meta(pattern="^(data:|https?://)")]
Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # an int64
# n: each choice is a stream of its own, run like that many requests; a bound keeps one
# body from holding more of a model's sequences than a few requests would
MAX_CHOICES = 16
Choices = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)]
# Each refused field: the values that ask for nothing, and why any other is refused.
Refused = dict[str, tuple[tuple[Any, ...], str]]
NO_TOOLS = "not supported: OpenAI's deprecated functions; send tools"


def refused_note(why: str) -> Any:
    """A field's type note in /openapi.json: taken only to be refused."""
    return msgspec.Meta(description=f"refused unless it asks for nothing ({why})")


NoTools = Annotated[list[Any] | None, refused_note("no tool calls")]
NoToolChoice = Annotated[str | dict[str, Any] | None, refused_note("no tool calls")]


class Options(msgspec.Struct, kw_only=True):
    """Extensions every endpoint takes (also as X-Modelpool-* headers)."""

    refused: ClassVar[Refused] = {}

    priority: Priority | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


class EmbeddingsBody(Options, kw_only=True):
    # Token arrays are accepted by the type only to be refused by name.
    input: str | Annotated[list[str | int | list[int]], msgspec.Meta(min_length=1)]
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None  # Matryoshka
    user: str | None = None


class ImageEmbeddingsBody(Options, kw_only=True):
    """Extension: images as `data:` URLs (or http(s) URLs where the daemon allows)."""

    input: ImageUrlText | Annotated[list[ImageUrlText], msgspec.Meta(min_length=1)]
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"


class ImageUrl(msgspec.Struct, kw_only=True):
    url: ImageUrlText
    detail: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant's tool calls only
    tool_calls: Annotated[list[MessageToolCall], msgspec.Meta(max_length=128)] | None = None
    tool_call_id: str | None = None  # a tool's answer: the call it answers


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class Sampling(Options, kw_only=True):
    model: str = ""
    max_tokens: Tokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=TOP_K_MAX)] | None = None  # vLLM's; -1, 0: all
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None  # extension, vLLM's
    stop: str | Stops | None = None
    stop_token_ids: StopTokenIds | None = None  # extension, vLLM's
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)] = 0  # extension, vLLM's
    seed: Seed | None = None
    n: Choices = 1  # seeded: choice i takes seed + i
    stream: bool = False
    stream_options: StreamOptions | None = None
    # chat: true or false, with top_logprobs alternatives; completions: the alternatives
    logprobs: bool | TopLogprobs | None = None
    top_logprobs: TopLogprobs | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's
    logit_bias: LogitBias | None = None  # token ids as strings, as JSON keys are
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's earlier names of the same
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: GuidedChoice | None = None
    guided_grammar: str | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] = ""  # vLLM's: prefix caching


class ChatBody(Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    # vLLM's: more variables for the chat template (its switches, such as enable_thinking)
    chat_template_kwargs: Annotated[dict[str, Any], msgspec.Meta(max_length=32)] | None = None
    reasoning_effort: Effort | None = None  # for a template that reads that variable
    max_completion_tokens: Tokens | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: NoTools = None
    function_call: NoToolChoice = None
    modalities: Annotated[list[str] | None, refused_note("text only")] = None
    audio: Annotated[dict[str, Any] | None, refused_note("text only")] = None
    refused: ClassVar[Refused] = {
        "functions": ((None, []), NO_TOOLS),
        "function_call": ((None, "none", "auto"), NO_TOOLS),
        "modalities": ((None, ["text"]), "only text"),
        "audio": ((None,), "not supported: only text"),
    }


class CompletionBody(Sampling, kw_only=True):
    # a prompt (text, or token ids as evaluation harnesses send them), or a list of them
    prompt: NonEmpty | Annotated[list[NonEmpty | TokenId | TokenIds],
                                 msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    refused: ClassVar[Refused] = {
        "top_logprobs": ((None, 0), "chat's: a completion takes logprobs: N"),
        "suffix": ((None, ""), "not supported"),
        "best_of": ((None, 1), "only 1 is supported; send several requests")}


class ImagesBody(Options, kw_only=True):
    prompt: NonEmpty
    model: str = ""
    n: int = 1
    size: str | None = None  # "WIDTHxHEIGHT"
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: Seed | None = None  # extension
    steps: Steps | None = None  # extension
    negative_prompt: str = ""  # extension
    output_format: Annotated[str | None, refused_note("png only")] = None
    background: Annotated[str | None, refused_note("opaque only")] = None
    user: str | None = None
    refused: ClassVar[Refused] = {
        "n": ((1,), "only n = 1 is supported; send several requests"),
        "response_format": (("b64_json",), "only b64_json: the daemon keeps no image files"),
        "output_format": ((None, "png"), "only png"),
        "background": ((None, "auto", "opaque"), "only opaque images"),
    }


class RerankBody(Options, kw_only=True):
    """Extension, in the shape Cohere, Jina and vLLM use."""

    query: NonEmpty
    documents: Texts
    model: str = ""
    top_n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    return_documents: bool = False


JOB_OPERATIONS = ("embeddings", "image_embeddings", "chat.completions", "completions",
                  "images.generations", "rerank")


class JobBody(Options, kw_only=True):
    """POST /v1/jobs: one of the endpoints' bodies, run as a job that outlives this
    connection; its result is fetched with GET /v1/jobs/{id}."""

    operation: Literal["embeddings", "image_embeddings", "chat.completions", "completions",
                       "images.generations", "rerank"]
    body: dict[str, Any]


@dataclass(frozen=True)
class PoolCall:
    """What a body asks of the pool: `client.<op>(*args, **kwargs)`; `made`: how a chat's
    text becomes tool calls, when its tool_choice forces one."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    made: ToolCalls | None = None


def bad(field: str, message: str) -> PoolError:
    return PoolError(ErrorCode.BAD_REQUEST, f"{field}: {message}")


def refuse_unsupported(body: Options) -> None:
    """A field of its body's `refused` set to anything but asking for nothing is refused
    by name: dropped, it would change the answer."""
    for name, (asks_nothing, why) in body.refused.items():
        if getattr(body, name) not in asks_nothing:
            raise bad(name, why)


def options(body: Options) -> dict[str, Any]:
    return {name: getattr(body, name) for name in ("priority", "timeout_s", "deadline_s")
            if getattr(body, name) is not None}


def embeddings_call(body: EmbeddingsBody) -> PoolCall:
    refuse_unsupported(body)
    if isinstance(body.input, list) and any(not isinstance(x, str) for x in body.input):
        raise bad("input", "token arrays are not supported; send text")
    texts = [body.input] if isinstance(body.input, str) else body.input
    return PoolCall("embed", (texts,), {"model": body.model or None,
                                        "dimensions": body.dimensions, **options(body)})


def image_embeddings_call(body: ImageEmbeddingsBody) -> PoolCall:
    urls = [body.input] if isinstance(body.input, str) else body.input
    images = [image_from_url(url, f"input[{i}]") for i, url in enumerate(urls)]
    return PoolCall("embed_image", (images,), {"model": body.model or None, **options(body)})


def image_from_url(url: str, field: str) -> ImageInput:
    """A `data:` URL's bytes, or an http(s) URL for the daemon to fetch (or refuse, by
    its [images] policy). Never a path: an HTTP client may not name local files."""
    if url.startswith(("http://", "https://")):
        return ImageInput(url=url)
    if not url.startswith("data:") or "," not in url:
        raise bad(field, "an image must be a data: URL or an http(s) URL")
    header, payload = url[5:].split(",", 1)
    if not header.endswith(";base64"):
        raise bad(field, "a data: URL must be base64 (data:image/png;base64,...)")
    try:
        return ImageInput(data=base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        raise bad(field, "not valid base64") from None


def sampling_kwargs(body: Sampling, max_tokens: int | None,
                    logprobs: int | None) -> dict[str, Any]:
    refuse_unsupported(body)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return {"model": body.model or None, "max_tokens": max_tokens or body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "top_k": None if body.top_k is None else max(body.top_k, 0), "min_p": body.min_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty, "logit_bias": body.logit_bias,
            "seed": body.seed, "stop": stop, "stop_token_ids": body.stop_token_ids,
            "min_tokens": body.min_tokens, "logprobs": logprobs,
            **language(body.response_format, body.structured_outputs, guided=(
                body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar)),
            **options(body)}


def choice_kwargs(kwargs: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The calls' arguments for n choices: a seeded one's i-th takes seed + i, so that
    they differ as a sampled request's do and each can be asked for again alone."""
    seed = kwargs.get("seed")
    return [kwargs if seed is None or i == 0 else {**kwargs, "seed": seed + i}
            for i in range(n)]


def images_call(body: ImagesBody) -> PoolCall:
    refuse_unsupported(body)
    width = height = None
    if body.size is not None and body.size != "auto":
        width, height = _size(body.size)
    return PoolCall("generate_image", (body.prompt,), {
        "model": body.model or None, "width": width, "height": height, "seed": body.seed,
        "steps": body.steps, "negative_prompt": body.negative_prompt, **options(body)})


def _size(size: str) -> tuple[int, int]:
    width, _, height = size.partition("x")
    sides = [int(side) for side in (width, height) if side.isdigit()]
    if len(sides) != 2 or not all(IMAGE_SIDE_MIN <= side <= IMAGE_SIDE_MAX
                                  and side % IMAGE_SIDE_STEP == 0 for side in sides):
        raise bad("size", f"WIDTHxHEIGHT in pixels, each a multiple of {IMAGE_SIDE_STEP} "
                          f"from {IMAGE_SIDE_MIN} to {IMAGE_SIDE_MAX} (e.g. 512x512)")
    return sides[0], sides[1]


def rerank_call(body: RerankBody) -> PoolCall:
    return PoolCall("rerank", (body.query, body.documents),
                    {"model": body.model or None, **options(body)})
