"""Responses kept for the Responses API: what `previous_response_id` continues and
GET /v1/responses/{id} shows. Each is kept with the input items that led to it, in the
front door's memory (as vLLM keeps them, in its server's memory; in a cluster, in its
PostgreSQL instead: response_store_pg.py), up to a bound in bytes shared fairly by their
owners. A response's id (random, 128 bits) is what protects it, as a job's key does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from modelpool.supervisor.httpapi.responses_in import ResponsesBody

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Kept:
    owner: str  # the client it is kept for (its API key, else its address): whose share
    items: list[dict[str, Any]]  # the conversation's items before it, then its own input
    body: ResponsesBody | None  # a background one's request, which its retrieval echoes
    response: dict[str, Any] | None  # as answered; None for a background one (its job's)
    size: int  # bytes, as JSON


class ResponseStore:
    """Bounded in bytes. Over the bound, the owner holding the most drops its least
    recently used: a client that floods the store drops its own responses, not others'."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._kept: dict[str, Kept] = {}
        self._by_owner: dict[str, OrderedDict[str, None]] = {}  # least recently used first
        self._owned: dict[str, int] = {}  # bytes
        # Each owner's input items by id, to the kept responses holding them (a
        # conversation's items are held by each of its later turns), oldest first, with
        # the item's place among their items: what an `item_reference` names. Per owner,
        # and by id: one client naming one id in many responses makes no other's lookup,
        # nor any removal, longer.
        self._item_holders: dict[tuple[str, str], dict[str, int]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def fits(self, items: list[dict[str, Any]]) -> bool:
        """Whether a response to these input items can be kept at all."""
        return len(_encoder.encode(items)) < self.max_bytes

    def keep(self, response_id: str, owner: str, items: list[dict[str, Any]],
             body: ResponsesBody, response: dict[str, Any] | None = None) -> bool:
        """Kept, dropping others as needed; False if it alone is over the bound. With its
        `response`, its request is not kept: the response echoes it."""
        size = (len(_encoder.encode(items))
                + len(_encoder.encode(body if response is None else response)))
        if size > self.max_bytes:
            return False
        self.forget(response_id)
        while self.used + size > self.max_bytes:
            largest = max(self._owned, key=self._owned.__getitem__)
            self.forget(next(iter(self._by_owner[largest])))
        self._kept[response_id] = Kept(owner, items,
                                       body if response is None else None, response, size)
        self._by_owner.setdefault(owner, OrderedDict())[response_id] = None
        for place, item_id in _ids(items):
            self._item_holders.setdefault((owner, item_id), {})[response_id] = place
        self._owned[owner] = self._owned.get(owner, 0) + size
        self.used += size
        return True

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._by_owner[kept.owner].move_to_end(response_id)
        return kept

    def input_item(self, item_id: str, owner: str) -> dict[str, Any] | None:
        """An input item of a response kept for this owner, by its id. Only the owner's:
        a client may have named the item itself (its id then guessable), while an output
        item's id is the response's own, random."""
        holders = self._item_holders.get((owner, item_id))
        if not holders:
            return None
        response_id, place = next(reversed(holders.items()))  # the latest
        self._by_owner[owner].move_to_end(response_id)
        return self._kept[response_id].items[place]

    def forget(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return False
        for _, item_id in _ids(kept.items):
            holders = self._item_holders.get((kept.owner, item_id))
            if holders is not None:  # None: an id the response holds twice, gone already
                holders.pop(response_id, None)
                if not holders:
                    del self._item_holders[kept.owner, item_id]
        del self._by_owner[kept.owner][response_id]
        self._owned[kept.owner] -= kept.size
        if not self._by_owner[kept.owner]:
            del self._by_owner[kept.owner], self._owned[kept.owner]
        self.used -= kept.size
        return True


def _ids(items: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(place, id) of the items that have an id."""
    return [(place, item["id"]) for place, item in enumerate(items)
            if isinstance(item.get("id"), str)]
