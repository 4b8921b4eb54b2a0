"""A completion's choices (OpenAI's `n`), each one generation stream from the pool: their
first chunks asked for together before the answer's status is sent, then their chunks
merged as they come (a streamed answer) or each gathered whole. One choice takes the
direct path: no task and no queue between its stream and the client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from modelpool.protocol.client_core import TextChunk, TextResult
from modelpool.protocol.messages import TokenLogprob

# Chunks of all the choices waiting for a slow HTTP client, at most: then the streams wait.
MERGED_CHUNKS = 64
Stream = AsyncGenerator[Any, None]


async def firsts(streams: list[Stream]) -> list[Any]:
    """Each stream's first chunk, asked for together; if any fails (an unknown model,
    a full queue), every stream is closed and the first failure raised."""
    try:
        if len(streams) == 1:
            return [await anext(streams[0])]
        got = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    failed = [g for g in got if isinstance(g, BaseException)]
    if failed:
        for stream in streams:
            await stream.aclose()
        raise failed[0]
    return got


async def chunks(first: list[Any], streams: list[Stream]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, chunk) of every stream as they come; a failure of one ends all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            yield 0, first[0]
            async for chunk in streams[0]:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(MERGED_CHUNKS)
    ended = object()

    async def pump(index: int, stream: Stream) -> None:
        async with contextlib.aclosing(stream):
            await queue.put((index, first[index]))
            try:
                async for chunk in stream:
                    await queue.put((index, chunk))
            except Exception as exc:
                await queue.put((index, exc))
                return
        await queue.put((index, ended))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is ended:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:  # ended, failed, or the HTTP client left: the others are cancelled
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather_all(first: list[Any], streams: list[Stream], model: str) -> list[TextResult]:
    """Each choice whole; a failure of one cancels the others and is raised."""
    if len(streams) == 1:
        return [await gather(first[0], streams[0], model)]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(gather(f, s, model))
                     for f, s in zip(first, streams, strict=True)]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def gather(first: Any, stream: Stream, model: str) -> TextResult:
    parts, logprobs, last = [first.text], list(first.logprobs or ()), first
    thinking = [first.reasoning]
    async with contextlib.aclosing(stream):
        async for chunk in stream:
            parts.append(chunk.text)
            thinking.append(chunk.reasoning)
            logprobs.extend(chunk.logprobs or ())
            last = chunk
    return whole_text(parts, logprobs, last, model, thinking)


def whole_text(parts: list[str], logprobs: list[TokenLogprob], last: TextChunk,
               model: str, thinking: list[str] | None = None) -> TextResult:
    """A stream's whole answer: its chunks' texts, thinking and logprobs, and its last
    chunk."""
    return TextResult("".join(parts), last.finish_reason or "stop", last.prompt_tokens or 0,
                      last.completion_tokens or 0, model, logprobs or None,
                      last.prompt_logprobs, last.tool_calls, last.cached_tokens or 0,
                      "".join(thinking or ()), last.reasoning_tokens or 0)
