"""A byte budget that trio tasks take from and give back to, waiting for room: the cache writer's queue."""

from __future__ import annotations

import trio


class ByteBudget:
    """Bytes taken and not yet given back, at most `limit` (one taker larger than the limit
    waits until nothing else is taken); `waiting` takers wait for room. For tasks of one
    trio run: no locking."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._taken = 0
        self.waiting = 0
        self._room = trio.Event()

    @property
    def taken(self) -> int:
        return self._taken

    async def take(self, size: int) -> None:
        self.waiting += 1
        waited = False
        try:
            while self._taken and self._taken + size > self._limit:
                waited = True
                await self._room.wait()
        finally:
            self.waiting -= 1
            if waited:  # got room or was cancelled: one fewer waits (wait_for_fewer_waiting)
                self._wake()
        self._taken += size

    async def wait_for_fewer_waiting(self, count: int) -> None:
        """Until fewer than `count` takers wait for room."""
        while self.waiting >= count:
            await self._room.wait()

    def give_back(self, size: int) -> None:
        self._taken -= size
        self._wake()

    def _wake(self) -> None:
        """Have everyone waiting on the budget look again."""
        self._room.set()
        self._room = trio.Event()
