"""Kept responses in the cluster's PostgreSQL (`modelpool.responses`), for a daemon with
a `[cluster]` database: every node's front door keeps and finds them there, so a
conversation goes on through any node's HTTP API (behind a load balancer, say), and
outlives a restart of the daemon or its front door. The same rules as in memory
(response_store.py): bounded in bytes (`[http] kept_responses_mib`, here for the whole
cluster), the owner holding the most dropping its least recently used; an input item
found by id for its owner only. The async face the Responses API uses, memory's too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from modelpool.supervisor.httpapi.response_store import Kept, ResponseStore
from modelpool.supervisor.httpapi.responses_in import ResponsesBody
from modelpool.supervisor.pgstore import SCHEMA, PgStore

_encoder = msgspec.json.Encoder()
TABLE = f"{SCHEMA}.responses"
OWNERS = f"{SCHEMA}.responses_owners"  # each owner's count and bytes, kept by a trigger
TRIM_LOCK = 0x6D6F64656C747269  # pg_advisory_xact_lock: one front door trims at a time


class MemoryKept:
    """The front door's own memory (a daemon without a cluster)."""

    def __init__(self, max_bytes: int) -> None:
        self.store = ResponseStore(max_bytes)

    def fits(self, items: list[dict[str, Any]]) -> bool:
        return self.store.fits(items)

    @property
    def count(self) -> int:
        return len(self.store)

    @property
    def used(self) -> int:
        return self.store.used

    async def keep(self, response_id: str, owner: str, items: list[dict[str, Any]],
                   body: ResponsesBody, response: dict[str, Any] | None = None) -> bool:
        return self.store.keep(response_id, owner, items, body, response)

    async def get(self, response_id: str) -> Kept | None:
        return self.store.get(response_id)

    async def forget(self, response_id: str) -> bool:
        return self.store.forget(response_id)

    async def input_item(self, item_id: str, owner: str) -> dict[str, Any] | None:
        return self.store.input_item(item_id, owner)

    async def close(self) -> None:
        return None


class PgKept:
    """In PostgreSQL; its statements fail as PoolError(UNAVAILABLE) while it is down."""

    def __init__(self, dsn: str, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.count = self.used = 0  # as last seen, for /metrics
        self._db = PgStore(dsn, lambda _channel, _payload: None, lambda: None, channels=())
        self._started = asyncio.Lock()

    def fits(self, items: list[dict[str, Any]]) -> bool:
        return len(_encoder.encode(items)) < self.max_bytes

    async def _fetch(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        async with self._started:  # the schema made (or migrated) once, at first use
            if not self._db.migrated:
                await self._db.pool.open(wait=False)
                await self._db.migrate()
        return await self._db.fetch(sql, params)

    async def keep(self, response_id: str, owner: str, items: list[dict[str, Any]],
                   body: ResponsesBody, response: dict[str, Any] | None = None) -> bool:
        kept_items = _encoder.encode(items)
        rest = _encoder.encode(body if response is None else response)
        size = len(kept_items) + len(rest)
        if size > self.max_bytes:
            return False
        await self._fetch(
            f"INSERT INTO {TABLE} (id, owner, items, body, response, size) "
            "VALUES (%s, %s, %s::jsonb, %s, %s::jsonb, %s) ON CONFLICT (id) DO UPDATE SET "
            "owner = excluded.owner, items = excluded.items, body = excluded.body, "
            "response = excluded.response, size = excluded.size, used_at = clock_timestamp()",
            (response_id, owner, kept_items.decode(), rest if response is None else None,
             rest.decode() if response is not None else None, size))
        await self._trim()
        return True

    async def _trim(self) -> None:
        """Over the bound, the owner holding the most drops its least recently used, one
        at a time (as in memory); one front door at a time, so that two keeping at once
        do not both drop for the same excess. Then the totals, for /metrics."""
        async with self._db.transaction() as cur:
            await cur.execute("SELECT pg_advisory_xact_lock(%s)", (TRIM_LOCK,))
            while await self._totals(cur) > self.max_bytes:
                await cur.execute(
                    f"DELETE FROM {TABLE} WHERE id = (SELECT id FROM {TABLE} WHERE owner = "
                    f"(SELECT owner FROM {OWNERS} ORDER BY used DESC LIMIT 1) "
                    "ORDER BY used_at LIMIT 1)")
                if cur.rowcount == 0:  # the owners' totals out of step: never spin
                    break

    async def _totals(self, cur: Any) -> int:
        await cur.execute(f"SELECT coalesce(sum(count), 0) AS count, "
                          f"coalesce(sum(used), 0) AS used FROM {OWNERS}")
        totals = await cur.fetchone()
        self.count, self.used = int(totals["count"]), int(totals["used"])
        return self.used

    async def get(self, response_id: str) -> Kept | None:
        rows = await self._fetch(
            f"UPDATE {TABLE} SET used_at = clock_timestamp() WHERE id = %s "
            "RETURNING owner, items, body, response, size", (response_id,))
        return _kept(rows[0]) if rows else None

    async def forget(self, response_id: str) -> bool:
        rows = await self._fetch(f"DELETE FROM {TABLE} WHERE id = %s RETURNING id",
                                 (response_id,))
        await self._trim()  # under the bound: only the totals, for /metrics
        return bool(rows)

    async def input_item(self, item_id: str, owner: str) -> dict[str, Any] | None:
        rows = await self._fetch(
            f"UPDATE {TABLE} SET used_at = clock_timestamp() WHERE id = (SELECT id FROM "
            f"{TABLE} WHERE owner = %s AND items @> %s::jsonb ORDER BY used_at DESC LIMIT 1) "
            "RETURNING items", (owner, _encoder.encode([{"id": item_id}]).decode()))
        if not rows:
            return None
        return next(item for item in reversed(rows[0]["items"]) if item.get("id") == item_id)

    async def close(self) -> None:
        await self._db.pool.close(timeout=2.0)


def _kept(row: dict[str, Any]) -> Kept:
    body = (msgspec.json.decode(row["body"], type=ResponsesBody)
            if row["body"] is not None else None)
    return Kept(row["owner"], row["items"], body, row["response"], row["size"])
