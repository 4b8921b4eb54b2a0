"""The value types the socket's messages share: priorities, capabilities, and the bounds
a request's numbers are checked against when it is decoded."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Priority = Literal["critical", "high", "normal", "low", "batch"]
PRIORITIES: tuple[Priority, ...] = ("critical", "high", "normal", "low", "batch")
Capability = str  # a capability named in protocol/kinds.py, e.g. "text_embedding"

MAX_TEXTS = 4096
MAX_TOKENS = 1 << 20
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Steps = Annotated[int, msgspec.Meta(ge=1, le=1000)]
IMAGE_SIDE_MIN, IMAGE_SIDE_MAX, IMAGE_SIDE_STEP = 8, 4096, 8  # pixels
ImageSide = Annotated[int, msgspec.Meta(ge=IMAGE_SIDE_MIN, le=IMAGE_SIDE_MAX,
                                        multiple_of=IMAGE_SIDE_STEP)]
Stops = Annotated[list[str], msgspec.Meta(max_length=16)]
Guidance = Annotated[float, msgspec.Meta(ge=0, le=100)]
TOP_K_MAX = 2**31 - 1  # any k at least the vocabulary is all of it
TopK = Annotated[int, msgspec.Meta(ge=0, le=TOP_K_MAX)]
MinP = Annotated[float, msgspec.Meta(ge=0, le=1)]
# OpenAI's: taken from the logit of a token once it is in the output (presence), or once
# for each time it is (frequency)
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
# vLLM's and transformers': the logit of a token already in the prompt or the output is
# divided by it if positive, multiplied if negative; 1: none. At least 0.01: dividing by
# a tiny one (5e-324) sends a positive logit to infinity and the sampler to NaN.
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=0.01, le=100)]
# OpenAI's: added to a token's logit before sampling, by token id; -100 bans it in effect,
# 100 all but forces it
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOP_K_MAX)]
LogitBias = Annotated[dict[TokenId, Annotated[float, msgspec.Meta(ge=-100, le=100)]],
                      msgspec.Meta(max_length=1024)]
# vLLM's: tokens that end a sequence as its end-of-sequence does, not output
StopTokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=64)]
# OpenAI's top_logprobs, vLLM's logprobs and prompt_logprobs: the likeliest alternatives
# reported beside each token's own log-probability (0: its own only)
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
# A chat request's function tools (OpenAI's shape) and its template's variables
Tools = Annotated[list[dict[str, Any]], msgspec.Meta(max_length=128)]
TemplateVariables = Annotated[dict[str, Any], msgspec.Meta(max_length=32)]
# A vision chat's images beside its first, and where each goes: its message's index, and
# how many characters into that message's text
MAX_MORE_IMAGES = 15
Place = Annotated[int, msgspec.Meta(ge=0)]
Places = Annotated[list[Place], msgspec.Meta(max_length=MAX_MORE_IMAGES)]


class RequestDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a request gets for a parameter its client left unset: the daemon's
    [defaults] table. The only place these values are written."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] = 256
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    steps: Steps = 25
    width: ImageSide = 512
    height: ImageSide = 512
    guidance: Guidance = 7.5


class Structured(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Output held to a language (vLLM's structured outputs): exactly one of these. The
    output ends where the language does: end-of-sequence is allowed there, and nothing
    else once the language is complete."""

    json_schema: str | None = None  # a JSON Schema as JSON text; '{"type": "object"}': any
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (llama.cpp's)


class Sampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How generate and describe pick their tokens. None: the model's recommendation
    (its generation_config.json), else the daemon's configured default (RequestDefaults),
    filled in when the request is admitted."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100)] | None = None  # 0: greedy
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: TopK | None = None  # the k likeliest tokens only; 0: all
    min_p: MinP | None = None  # tokens below min_p x the likeliest's probability: out
    presence_penalty: Penalty | None = None  # 0: none
    frequency_penalty: Penalty | None = None  # 0: none
    repetition_penalty: RepetitionPenalty | None = None  # 1: none
    logit_bias: LogitBias | None = None  # added to those tokens' logits, first
    seed: int | None = None  # None: a random seed per request
    stop: Stops = []  # cut from the output
    stop_token_ids: StopTokenIds = []  # end it as end-of-sequence does, ignore_eos or not
    # nothing ends it before this many tokens: eos and stop tokens are not sampled, stop
    # strings not looked for
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)] = 0
    ignore_eos: bool = False
    # each output token's log-probability and this many likeliest alternatives, from the
    # model's raw logits (before biases, penalties and temperature); None: none
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None  # the same for each prompt token (End's)
    structured: Structured | None = None  # None: free text
