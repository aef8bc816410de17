"""`BlockHub`: what the fetch layer asks of the hub, so a test can give it a fake in place of HubClient."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..buffers import Buffer

# Takes each piece of a ranged answer as it arrives: (index, bytes, the answer's checksums by block number).
PieceSink = Callable[[int, Buffer, dict[int, int]], Awaitable[None]]


class BlockHub(Protocol):
    """Block data and checksums of file versions (fetch/hub_client.HubClient over HTTP); raises HubError."""

    async def get_range(
        self,
        file_id: str,
        version: str,
        start: int,
        lengths: Sequence[int],
        *,
        sums_block_size: int | None = None,
        on_piece: PieceSink | None = None,
    ) -> tuple[list[Buffer], dict[int, int]]:
        """Consecutive pieces of `lengths` bytes from `start`; with `sums_block_size`, the xxh3-64 of
        each block the hub sent in the answer's header (block number -> checksum). With
        `on_piece`, each piece is awaited into it as it arrives, in order, and not returned
        (a piece may come twice where an answer failed part way and another source was asked)."""
        ...

    async def get_batch(
        self,
        files: Sequence[tuple[str, str]],
        lengths: Sequence[int],
        block_size: int,
        on_file: Callable[[int, Buffer, int], Awaitable[None]],
    ) -> None:
        """Whole small files (id, version) in one request; `await on_file(index, bytes, checksum)` as
        each arrives, before the next is received."""
        ...

    async def get_checksums(self, file_id: str, version: str, block_size: int, first: int, count: int) -> list[int]:
        """xxh3-64 of blocks [first, first + count) of one file version."""
        ...
