"""Turns per client in front of a shared pool: one client never holds more than its share.

The hashing threads (and the batch slots) are shared by every client of the
hub; without turns, one client sending many requests fills the pool's queue
and everyone else waits behind it. A client is what the connection limits
count as one: an IPv4 address, or an IPv6 /64.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class PerClientTurns:
    """At most `per_client` jobs of one client at once; its further jobs wait (in the
    event loop, not in the pool's queue) until one of its own is done."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._users: collections.Counter[str] = collections.Counter()  # jobs running or waiting, by client

    def busy(self, client: str) -> bool:
        """Whether `client` has all its turns taken now."""
        slots = self._slots.get(client)
        return slots is not None and slots.locked()

    @contextlib.asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        """Wait for one of `client`'s turns and hold it for the block."""
        slots = self._slots.get(client)
        if slots is None:
            slots = self._slots[client] = asyncio.Semaphore(self.per_client)
        self._users[client] += 1
        try:
            async with slots:
                yield
        finally:
            self._users[client] -= 1
            if not self._users[client]:
                del self._users[client], self._slots[client]
