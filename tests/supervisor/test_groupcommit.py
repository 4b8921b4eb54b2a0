"""Group commit: calls made while a statement is in flight share the next one."""

from __future__ import annotations

import asyncio

import pytest

from modelpool.supervisor.groupcommit import GroupCommit


class Statements:
    """A statement that runs only when the test lets it, recording each batch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.fail: Exception | None = None

    async def __call__(self, items: list[int]) -> list[int | Exception]:
        self.batches.append(items)
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_call_runs_at_once_and_later_calls_share_the_next_statement() -> None:
    statements = Statements()
    commit = GroupCommit(statements)
    first = asyncio.ensure_future(commit(0))
    await _settle()
    assert statements.batches == [[0]]  # not held back to wait for company
    rest = [asyncio.ensure_future(commit(i)) for i in (2, 4, 6)]
    await _settle()
    assert statements.batches == [[0]]  # they wait for the statement in flight
    statements.gate.set()
    assert await first == 0
    assert await asyncio.gather(*rest) == [20, 40, 60]
    assert statements.batches == [[0], [2, 4, 6]]


async def test_an_outcome_that_is_an_exception_fails_its_call_alone() -> None:
    statements = Statements()
    statements.gate.set()
    commit = GroupCommit(statements)
    calls = [asyncio.ensure_future(commit(i)) for i in (2, 3)]
    done = await asyncio.gather(*calls, return_exceptions=True)
    assert done[0] == 20 and isinstance(done[1], ValueError)


async def test_a_failed_statement_fails_its_batch_and_the_next_batch_runs() -> None:
    statements = Statements()
    commit = GroupCommit(statements)
    statements.fail = RuntimeError("server gone")
    first = asyncio.ensure_future(commit(2))
    await _settle()
    second = asyncio.ensure_future(commit(4))
    await _settle()
    statements.gate.set()
    with pytest.raises(RuntimeError, match="server gone"):
        await first
    with pytest.raises(RuntimeError):  # the next batch met the same failure, on its own
        await second
    statements.fail = None
    assert await commit(8) == 80
    assert statements.batches == [[2], [4], [8]]


async def test_batches_are_bounded() -> None:
    statements = Statements()
    commit = GroupCommit(statements, max_batch=2)
    blocker = asyncio.ensure_future(commit(0))
    await _settle()
    calls = [asyncio.ensure_future(commit(i)) for i in (2, 4, 6, 8, 10)]
    await _settle()
    statements.gate.set()
    await asyncio.gather(blocker, *calls)
    assert [len(b) for b in statements.batches] == [1, 2, 2, 1]


async def test_a_cancelled_caller_does_not_stop_the_others() -> None:
    statements = Statements()
    commit = GroupCommit(statements)
    blocker = asyncio.ensure_future(commit(0))
    await _settle()
    leaving, staying = asyncio.ensure_future(commit(2)), asyncio.ensure_future(commit(4))
    await _settle()
    leaving.cancel()
    statements.gate.set()
    assert await blocker == 0 and await staying == 40
    assert statements.batches == [[0], [2, 4]]
