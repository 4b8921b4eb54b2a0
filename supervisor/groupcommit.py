"""Group commit: calls of one kind made while a statement of that kind is in flight go
together in the next statement, so a busy daemon sends one statement for many jobs and
an idle one sends each call at once, as it comes.

A statement costs PostgreSQL its parsing, planning and commit, and the daemon a round
trip and the driver's per-statement work, whatever the number of rows it carries; with
many clients these per-statement costs were most of a job's CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")

MAX_BATCH = 256  # calls per statement: bounds a statement's size and a row lock's span

# The statement for a batch of calls: one outcome per call, in order (an exception as an
# outcome fails that call alone; one raised fails the whole batch).
Statement = Callable[[list[In]], Awaitable[Sequence[Out | BaseException]]]


class GroupCommit(Generic[In, Out]):
    def __init__(self, statement: Statement[In, Out], max_batch: int = MAX_BATCH) -> None:
        self._statement = statement
        self._max_batch = max_batch
        self._waiting: list[tuple[In, asyncio.Future[Out]]] = []
        self._flushing: asyncio.Task[None] | None = None

    async def __call__(self, item: In) -> Out:
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[:self._max_batch]
                del self._waiting[:self._max_batch]
                await self._run(batch)
        finally:
            self._flushing = None
            if self._waiting:  # cancelled (the daemon is stopping): so are the calls
                for _, future in self._waiting:
                    future.cancel()
                self._waiting.clear()

    async def _run(self, batch: list[tuple[In, asyncio.Future[Out]]]) -> None:
        try:
            outcomes = await self._statement([item for item, _ in batch])
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # its caller was cancelled: the statement ran all the same
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
