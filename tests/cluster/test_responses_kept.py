"""The Responses API's kept responses in a cluster's PostgreSQL: kept, found and removed
by every node's front door, bounded for the cluster with the owner holding the most
dropping its least recently used, an input item found for its owner only; and through
two real daemons and the openai SDK, a conversation goes on through either node."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest
from cluster_helpers import (
    Daemon,
    Database,
    model_entry,
    node_config,
    nodes_seeing_each_other,
    start_node,
    wait_until,
)

from modelpool.protocol.errors import ErrorCode, PoolError
from modelpool.supervisor.httpapi.response_store_pg import PgKept
from modelpool.supervisor.httpapi.responses_in import ResponsesBody

BODY = ResponsesBody(input="hi")


def _items(*ids: str) -> list[dict[str, str]]:
    return [{"type": "message", "role": "user", "content": f"text of {i}", "id": i}
            for i in ids]


def _size(items: list[dict[str, str]], response: dict[str, str]) -> int:
    return len(msgspec.json.encode(items)) + len(msgspec.json.encode(response))


async def test_kept_found_and_removed_by_every_front_door(database: Database) -> None:
    one, other = PgKept(database.dsn, 1 << 20), PgKept(database.dsn, 1 << 20)
    try:
        assert await one.keep("r1", "A", _items("m1"), BODY, {"id": "r1", "output": []})
        assert await one.keep("bg", "A", _items("m2"), BODY)  # a background one: its body
        found = await other.get("r1")
        assert found is not None and (found.owner, found.items, found.response) == (
            "A", _items("m1"), {"id": "r1", "output": []})
        background = await other.get("bg")
        assert background is not None and background.body == BODY
        assert background.response is None
        assert await other.input_item("m2", "A") == _items("m2")[0]
        assert await other.input_item("m2", "B") is None  # A's only
        assert await other.forget("r1") and await one.get("r1") is None
        assert not await one.forget("r1")
        assert one.count == other.count == 1  # the cluster's, as each last saw it
        assert one.used == len(msgspec.json.encode(_items("m2"))) + len(
            msgspec.json.encode(BODY))
    finally:
        await one.close()
        await other.close()


async def test_over_the_bound_the_owner_holding_most_drops_its_least_recently_used(
        database: Database) -> None:
    response = {"id": "r"}
    size = _size(_items("x" * 100), response)
    kept = PgKept(database.dsn, 4 * size)
    try:
        assert await kept.keep("b1", "B", _items("x" * 100), BODY, response)
        for index in range(6):
            assert await kept.keep(f"a{index}", "A", _items("x" * 100), BODY, response)
        assert [await kept.get(n) is not None for n in ("b1", "a2", "a3", "a4", "a5")] == [
            True, False, True, True, True]
        assert await kept.get("a3") is not None  # used: now A's most recent
        assert await kept.keep("a6", "A", _items("x" * 100), BODY, response)
        assert await kept.get("a4") is None and await kept.get("a3") is not None
        assert (kept.count, kept.used) == (4, 4 * size)
        assert not await kept.keep("huge", "B", _items("x" * 5 * size), BODY, response)
    finally:
        await kept.close()


def _scanned(database: Database) -> list[tuple[object, ...]]:
    return database.query("SELECT owner, count(*)::int, sum(size)::bigint FROM "
                          "modelpool.responses GROUP BY owner ORDER BY owner")


def _owners(database: Database) -> list[tuple[object, ...]]:
    return database.query("SELECT owner, count, used FROM modelpool.responses_owners "
                          "ORDER BY owner")


async def test_each_owners_totals_follow_every_change(database: Database) -> None:
    kept = PgKept(database.dsn, 1 << 20)
    try:
        for index in range(3):
            assert await kept.keep(f"a{index}", "A", _items("m" * index), BODY, {"id": "r"})
        assert await kept.keep("b", "B", _items("m"), BODY)
        assert await kept.keep("a1", "B", _items("longer"), BODY)  # kept again: moved
        await kept.get("a0")  # a use changes no size
        assert _owners(database) == _scanned(database) and len(_scanned(database)) == 2
        assert await kept.forget("a0") and await kept.forget("a2")
        assert _owners(database) == _scanned(database) == [("B", 2, kept.used)]
        assert await kept.forget("b") and await kept.forget("a1")
        assert _owners(database) == [] and (kept.count, kept.used) == (0, 0)
    finally:
        await kept.close()


async def test_front_doors_keeping_at_once_drop_only_the_excess(database: Database) -> None:
    response = {"id": "r"}
    size = _size(_items("x" * 100), response)
    doors = [PgKept(database.dsn, 5 * size) for _ in range(4)]
    try:
        await asyncio.gather(*(door.keep(f"r{door_index}-{index}", f"owner{index % 2}",
                                         _items("x" * 100), BODY, response)
                               for index in range(12)
                               for door_index, door in enumerate(doors)))
        assert sum(count for _, count, _ in _scanned(database)) == 5
        assert _owners(database) == _scanned(database)
    finally:
        await asyncio.gather(*(door.close() for door in doors))


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def two_front_doors(tmp_path: Path, database: Database) -> Iterator[list[str]]:
    """Two nodes, each with its HTTP API (open: loopback only) and the counting
    generator: each answers what it is asked; only the database is shared."""
    gen = model_entry("gen", loader="counting_generator", capability="text_to_text",
                      step_s=0.01)
    addresses = [_free_address(), _free_address()]
    starts = [lambda name=name, address=address: start_node(
        tmp_path / name,
        node_config(database.dsn, name, gen) + f'[http]\nlisten = "{address}"\n')
        for name, address in zip(("alpha", "beta"), addresses, strict=True)]
    with nodes_seeing_each_other(*starts) as daemons:
        _wait_for_http(daemons, addresses)
        yield [f"http://{address}/v1" for address in addresses]


def _wait_for_http(daemons: list[Daemon], addresses: list[str]) -> None:
    def up(address: str) -> bool:
        host, port = address.rsplit(":", 1)
        with socket.socket() as probe:
            return probe.connect_ex((host, int(port))) == 0

    for address in addresses:
        wait_until(lambda a=address: up(a), 30, f"the HTTP API on {address}")


def test_a_conversation_goes_on_through_either_node(two_front_doors: list[str]) -> None:
    alpha, beta = (openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
                   for url in two_front_doors)
    first = alpha.responses.create(model="gen", input="hello", max_output_tokens=3)
    assert first.output_text == "tok0 tok1 tok2 "
    second = beta.responses.create(model="gen", previous_response_id=first.id,
                                   input="and then?", max_output_tokens=2)
    assert second.output_text == "tok0 tok1 "
    assert beta.responses.retrieve(first.id).output_text == first.output_text
    listed = [item.id for item in alpha.responses.input_items.list(second.id, order="asc")]
    assert len(listed) == 3 and listed[1] == first.output[0].id  # its answer, then input
    named = alpha.responses.create(model="gen", max_output_tokens=1, input=[
        {"type": "item_reference", "id": listed[0]}])  # an input item kept on beta's turn
    assert named.output_text == "tok0 "
    with alpha.responses.create(model="gen", input="streamed", stream=True,
                                max_output_tokens=2) as events:
        last = next(e for e in events if e.type == "response.incomplete")  # then closed
    streamed = last.response  # type: ignore[union-attr]
    assert streamed.output_text == "tok0 tok1 "
    # a streamed one is kept too, and continued on the other node as its stream ends
    after = beta.responses.create(model="gen", previous_response_id=streamed.id,
                                  input="more", max_output_tokens=1)
    assert after.output_text == "tok0 "
    beta.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        alpha.responses.create(model="gen", previous_response_id=first.id, input="x")


async def test_a_database_out_of_reach_is_unavailable_not_a_hang() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kept = PgKept(f"postgresql://mp@127.0.0.1:{port}/mp", 1 << 20)
    try:
        with pytest.raises(PoolError) as refused:
            await asyncio.wait_for(kept.get("r1"), 30)
        assert refused.value.code is ErrorCode.UNAVAILABLE
    finally:
        await kept.close()
