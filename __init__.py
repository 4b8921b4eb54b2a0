"""modelpool: a daemon that keeps ML models loaded in worker processes and serves them.

    from modelpool import Client, AsyncClient, PoolError

The client names are loaded on first use, so that the daemon, which imports
modelpool.supervisor, never pays for the client's imports (numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modelpool.protocol.client import AsyncClient, Client
    from modelpool.protocol.errors import ErrorCode, PoolError

__all__ = ["AsyncClient", "Client", "ErrorCode", "PoolError"]


def __getattr__(name: str) -> Any:
    if name in ("Client", "AsyncClient"):
        from modelpool.protocol import client

        return getattr(client, name)
    if name in ("ErrorCode", "PoolError"):
        from modelpool.protocol import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'modelpool' has no attribute {name!r}")
