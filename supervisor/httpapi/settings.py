"""The front door's settings: light to import, for the supervisor that sends them."""

from __future__ import annotations

import msgspec

from modelpool.protocol.fields import Priority

STOP_GRACE_S = 5.0  # what a stop of the daemon gives the front door's requests in flight


class HttpSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the front door needs of the daemon's config (sent to its process whole)."""

    socket_path: str
    api_keys: list[str] = []
    metrics_need_key: bool = True
    max_body_bytes: int = 64 * 1024 * 1024
    body_timeout_s: float = 30.0
    connections: int = 8
    max_priority: Priority = "critical"
    requests_per_minute: int = 0  # each client's (ratelimits.py); 0: no limit
    prefix_cache_per_key: bool = True
    kept_responses_bytes: int = 64 * 2**20  # the Responses API's kept responses, at most
    # The cluster's PostgreSQL, where they are kept when there is one ("": in memory)
    kept_responses_postgres: str = ""
    # The model answering a request that names none, by capability (a reload sends new).
    default_models: dict[str, str] = {}
