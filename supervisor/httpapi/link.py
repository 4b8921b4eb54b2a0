"""The HTTP front door's way to the pool: a few connections to the daemon's socket.

Each HTTP client (by API key, else by address) keeps to one connection, and the daemon
shares its time fairly between connections: one HTTP client's flood waits behind its
own work, not everybody's. A lost connection is opened again at the next request.
"""

from __future__ import annotations

import asyncio
import zlib

from modelpool.protocol.client import AsyncClient
from modelpool.protocol.errors import PoolError


class DaemonLink:
    def __init__(self, socket_path: str, connections: int) -> None:
        self.socket_path = socket_path
        self._clients: list[AsyncClient | None] = [None] * connections
        self._opening: list[asyncio.Lock] = [asyncio.Lock() for _ in range(connections)]

    async def client(self, who: str = "") -> AsyncClient:
        """The connection for this HTTP client; UNAVAILABLE if the daemon cannot be
        reached."""
        index = zlib.crc32(who.encode()) % len(self._clients)
        current = self._clients[index]
        if current is not None and current.connected:
            return current
        async with self._opening[index]:
            current = self._clients[index]
            if current is not None and current.connected:
                return current
            if current is not None:
                await current.close()
            fresh = AsyncClient(self.socket_path, name=f"http-{index}")
            await fresh.connect()
            self._clients[index] = fresh
            return fresh

    async def any_client(self) -> AsyncClient:
        """A connection already open, if there is one, else the first: for what any
        connection answers alike (status), as the daemon takes no new connection while
        it drains."""
        for client in self._clients:
            if client is not None and client.connected:
                return client
        return await self.client()

    async def close(self) -> None:
        for client in self._clients:
            if client is not None:
                await client.close()

    async def ready(self) -> bool:
        """The daemon answers and accepts work."""
        try:
            status = await (await self.any_client()).status()
        except PoolError:
            return False
        return not status["shutting_down"]
