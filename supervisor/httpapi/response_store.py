"""Responses kept for the Responses API: what `previous_response_id` continues and
GET /v1/responses/{id} shows. Each is kept with the conversation that led to it, in the
front door's memory, up to a bound in bytes, the least recently used dropped first (as
vLLM keeps them, in its server's memory). A response's id (random, 128 bits) is what
protects it, as a job's key does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from modelpool.supervisor.httpapi.bodies import ChatMessage
from modelpool.supervisor.httpapi.responses_in import ResponsesBody

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Kept:
    conversation: list[ChatMessage]  # the turns before it, then its own input
    body: ResponsesBody | None  # a background one's request, which its retrieval echoes
    response: dict[str, Any] | None  # as answered; None for a background one (its job's)
    size: int  # bytes, as JSON


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def fits(self, conversation: list[ChatMessage]) -> bool:
        """Whether a response to this conversation can be kept at all."""
        return len(_encoder.encode(conversation)) < self.max_bytes

    def keep(self, response_id: str, conversation: list[ChatMessage], body: ResponsesBody,
             response: dict[str, Any] | None = None) -> bool:
        """Kept, dropping the least recently used as needed; False if it alone is over
        the bound. With its `response`, its request is not kept: the response echoes it."""
        size = (len(_encoder.encode(conversation))
                + len(_encoder.encode(body if response is None else response)))
        if size > self.max_bytes:
            return False
        self.forget(response_id)
        while self.used + size > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self.used -= dropped.size
        self._kept[response_id] = Kept(conversation, body if response is None else None,
                                       response, size)
        self.used += size
        return True

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def forget(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is None:
            return False
        self.used -= kept.size
        return True
