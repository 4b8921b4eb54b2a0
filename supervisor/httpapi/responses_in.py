"""OpenAI's Responses API (`POST /v1/responses`, the SDK's `responses.create`, `.parse`
and `.stream`, and what the OpenAI Agents SDK sends) taken as the chat it describes:
`instructions` and the `input` items become chat messages (a function call and its
output become an assistant's tool call and a tool's answer), the flat function tools and
`text.format` chat's nested ones, and the chat's own path does the rest.

`previous_response_id` continues a response the front door keeps (response_store.py):
the conversation that led to it, then its output items, before this input; an
`item_reference` to one of those output items, or to an input item of a response kept
for the same client, is replaced by it (responses_api.py). A
`conversation` object is refused by name (no conversations are kept apart from their
responses), as are OpenAI's hosted tools (web search, file search, ...), which no model
here has, and a reasoning summary (none is made); `reasoning.effort` goes to a template
that reads that variable. An earlier answer's reasoning item sent back as input is taken and
left out of the conversation, as the reasoning models' templates leave out earlier
thinking.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from modelpool.protocol.fields import TOP_K_MAX, Stops, TopLogprobs
from modelpool.protocol.messages import Effort
from modelpool.supervisor.httpapi.bodies import (
    ChatBody,
    ChatMessage,
    ContentPart,
    ImageUrl,
    Options,
    PoolCall,
    Refused,
    Seed,
    Tokens,
    bad,
    refuse_unsupported,
    refused_note,
)
from modelpool.supervisor.httpapi.chat import chat_call
from modelpool.supervisor.httpapi.structured import JsonSchemaFormat, ResponseFormat
from modelpool.supervisor.httpapi.tools import (
    CalledFunction,
    FunctionDef,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    Tool,
    ToolCalls,
    tool_calls,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
NOT_KEPT = ("not supported: no conversations are kept apart from their responses; "
            "continue one with previous_response_id, or send the whole conversation")


class InputPart(msgspec.Struct, kw_only=True):
    """A part of an input message: text (the user's, or an earlier answer's), an image."""

    type: str  # input_text, output_text, refusal, input_image; others refused by name
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


Parts = str | list[InputPart]


class ReasoningOptions(msgspec.Struct, kw_only=True):
    """How much a reasoning model thinks (for a template that reads it); no
    summary of the thinking is made."""

    effort: Effort | None = None
    summary: str | None = None
    generate_summary: str | None = None  # OpenAI's earlier name of summary


class InputItem(msgspec.Struct, kw_only=True):
    """One item of `input`: a message (`type` may be left out), a function call an
    earlier answer made, or its output."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Parts | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Parts | None = None
    id: str | None = None
    status: str | None = None
    summary: list[InputPart] | None = None  # a reasoning item's (its content: its thinking)
    encrypted_content: str | None = None  # a reasoning item's: none is made here


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str  # "function"; OpenAI's hosted tools are refused by name
    name: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, kw_only=True):
    type: str  # "function"
    name: str | None = None


class TextFormat(JsonSchemaFormat, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: Annotated[str | None, refused_note("no model here takes it")] = None


class ResponsesBody(Options, kw_only=True):
    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    model: str = ""
    instructions: str | None = None
    max_output_tokens: Tokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    stream: bool = False
    tools: Annotated[list[FunctionTool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Annotated[str | None, refused_note("disabled only")] = None
    # A kept response this one continues (ours are 37 characters: resp_ and 32 hex digits)
    previous_response_id: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    conversation: Annotated[Any, refused_note("no conversations kept")] = None
    background: bool | None = None  # run as a job: GET /v1/responses/{id} shows it
    reasoning: ReasoningOptions | None = None
    prompt: Annotated[dict[str, Any] | None, refused_note("no stored prompts")] = None
    max_tool_calls: Annotated[int | None, refused_note("one answer's calls only")] = None
    # vLLM's extensions, as in its chat bodies
    seed: Seed | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=TOP_K_MAX)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    stop: str | Stops | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=256)] = ""
    refused: ClassVar[Refused] = {
        "conversation": ((None,), NOT_KEPT),
        "truncation": ((None, "disabled"), "only disabled: a prompt over the model's "
                                           "context is refused, not cut"),
        "prompt": ((None,), "not supported: the daemon keeps no prompts"),
        "max_tool_calls": ((None,), "not supported: an answer makes the calls it makes"),
    }


def responses_call(body: ResponsesBody, turns: list[ChatMessage] | None = None) -> PoolCall:
    """The chat a Responses body describes, as the chat endpoint would call the pool;
    `turns`: the conversation it answers (`conversation`), by default its input alone."""
    return chat_call(chat_body(body, turns))


def response_tools(body: ResponsesBody) -> ToolCalls | None:
    """How its answer's output becomes calls, as its pool call reads it."""
    return tool_calls(_tools(body.tools), _tool_choice(body.tool_choice),
                      body.parallel_tool_calls)[0]


def chat_body(body: ResponsesBody, turns: list[ChatMessage] | None = None) -> ChatBody:
    refuse_unsupported(body)
    for name in body.include or ():
        if name != LOGPROBS_INCLUDE:
            raise bad("include", f"{name!r} is not supported; only {LOGPROBS_INCLUDE!r}")
    if body.reasoning and (body.reasoning.summary or body.reasoning.generate_summary):
        raise bad("reasoning.summary", "not supported: no summary of the thinking is made "
                  "(a reasoning model's thinking is its reasoning item's content)")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise bad("text.verbosity", "not supported: no model here takes it")
    logprobs = LOGPROBS_INCLUDE in (body.include or ())
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    turns = conversation(body, []) if turns is None else turns
    return ChatBody(
        messages=[*system, *turns], model=body.model, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        stop=body.stop, seed=body.seed, logprobs=logprobs,
        top_logprobs=body.top_logprobs if logprobs else None, tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_format(body.text), cache_salt=body.cache_salt, user=body.user,
        priority=body.priority, timeout_s=body.timeout_s, deadline_s=body.deadline_s,
        reasoning_effort=body.reasoning.effort if body.reasoning else None)


def conversation(body: ResponsesBody, before: list[ChatMessage]) -> list[ChatMessage]:
    """The turns before this input (a continued response's, whose `instructions` are not
    carried over, as OpenAI does), then its items; `instructions` go before it all."""
    return [*before, *input_messages(body.input, "input")]


def continued(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """A kept response's input items and its answer (its output items, which are input
    items too) as the turns of the response that continues it."""
    return input_messages(msgspec.convert(items, list[InputItem]), "previous_response_id")


def input_messages(items: str | list[InputItem], where: str) -> list[ChatMessage]:
    """Input items as chat messages, in order; function calls join the assistant message
    before them, as a chat answer holds its calls."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for index, item in enumerate(items):
        field = f"{where}[{index}]"
        if item.type == "message":
            if item.role is None or item.content is None:
                raise bad(field, "a message needs its role and content")
            out.append(ChatMessage(role=item.role, content=_content(item.content, field)))
        elif item.type == "function_call":
            call = _function_call(item, field)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "reasoning":
            continue  # earlier thinking: not shown to the model again
        elif item.type == "function_call_output":
            if item.output is None or not item.call_id:
                raise bad(field, "a function_call_output needs its call_id and output")
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_content(item.output, field)))
        else:
            raise bad(field, f"items of type {item.type!r} are not supported: messages, "
                             "function_call, function_call_output and reasoning are")
    return out


def _content(content: Parts, field: str) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    parts = []
    for index, part in enumerate(content):
        if part.type in ("input_text", "output_text", "refusal"):
            parts.append(ContentPart(type="text", text=part.text or part.refusal or ""))
        elif part.type == "input_image" and part.image_url:
            parts.append(ContentPart(type="image_url", image_url=ImageUrl(url=part.image_url)))
        else:
            raise bad(f"{field}.content[{index}]", f"{part.type!r} is not supported: "
                      "input_text and input_image (with an image_url) are")
    return parts


def _function_call(item: InputItem, field: str) -> MessageToolCall:
    if not item.name or item.arguments is None:
        raise bad(field, "a function_call needs its name and arguments")
    return MessageToolCall(function=CalledFunction(name=item.name, arguments=item.arguments),
                           id=item.call_id or "")


def _tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for index, tool in enumerate(tools):
        if tool.type != "function" or tool.name is None:
            raise bad(f"tools[{index}]", f"{tool.type!r} tools are not supported: function "
                                         "tools (with a name) are")
        out.append(Tool(type="function", function=FunctionDef(
            name=tool.name, description=tool.description, parameters=tool.parameters,
            strict=tool.strict)))
    return out


def _tool_choice(choice: str | FunctionChoice | None) -> Any:
    if not isinstance(choice, FunctionChoice):
        return choice
    if choice.type != "function" or not choice.name:
        raise bad("tool_choice", "a named choice must be a function's: "
                                 '{"type": "function", "name": ...}')
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def _format(text: TextConfig | None) -> ResponseFormat | None:
    if text is None or text.format is None:
        return None
    form = text.format
    return ResponseFormat(type=form.type, json_schema=JsonSchemaFormat(
        name=form.name, description=form.description, schema=form.schema, strict=form.strict))
