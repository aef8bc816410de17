"""Expected checksums of hub blocks: asked for in aligned spans, remembered, single-flight.

Every block received from the hub is checked against the xxh3-64 the hub
computed for it (`/v1/files/{id}/checksums`), so a bit flipped or a body
cut short anywhere on the way is detected and the block fetched again.
The checksum request runs beside the data request: it adds no round trip.
A request for a single block whose checksum is not known asks for it in
the data answer's header instead (one request, not two: what a small file
costs).
"""

from __future__ import annotations

import collections

import trio

from ..cache import BlockKey
from ..errors import HubProtocolError
from .hub import BlockHub

# Checksums are asked for 64 blocks at a time (512 bytes of answer): one
# request per 64 MiB of a sequential read...
SPAN_BLOCKS = 64
# ... but blocks of at most this many bytes in all: what the hub hashes for one
# request (hubserver/checksums.py MAX_HASHED_BYTES).
HUB_MAX_HASHED_BYTES = 256 << 20
# Remembered checksums (8 bytes each plus dict overhead, ~1 MB in all).
REMEMBERED = 16384


class BlockChecksums:
    """The hub's checksum of each block, fetched on demand."""

    def __init__(self, client: BlockHub, block_size: int) -> None:
        self._client = client
        self._block_size = block_size
        self._span_blocks = max(1, min(SPAN_BLOCKS, HUB_MAX_HASHED_BYTES // block_size))
        self._known: collections.OrderedDict[tuple[bytes, bytes, int], int] = collections.OrderedDict()
        self._spans_in_flight: dict[tuple[bytes, bytes, int], trio.Event] = {}

    async def expected(self, first: BlockKey, count: int) -> list[int]:
        """Checksums of blocks first.blockno .. +count of that file version."""
        wanted = [(first.file_id, first.version, first.blockno + i) for i in range(count)]
        for span in sorted({blockno // self._span_blocks for _f, _v, blockno in wanted}):
            if any(key not in self._known for key in wanted if key[2] // self._span_blocks == span):
                await self._load_span(first.file_id, first.version, span)
        sums = []
        for key in wanted:
            checksum = self._known.get(key)
            if checksum is None:  # beyond the end of the file by the hub's account, or a failed span
                raise HubProtocolError(f"hub has no checksum for block {key[2]} of file {first.file_id.hex()}")
            sums.append(checksum)
        return sums

    def known(self, first: BlockKey, count: int) -> list[int] | None:
        """The remembered checksums of blocks first.blockno .. +count, None unless all are known."""
        sums = [self._known.get((first.file_id, first.version, first.blockno + i)) for i in range(count)]
        return None if None in sums else sums  # type: ignore[return-value]

    def remember(self, first: BlockKey, sums: dict[int, int]) -> None:
        """Checksums the hub sent beside data, by block number."""
        for blockno, checksum in sums.items():
            self._known[(first.file_id, first.version, blockno)] = checksum
        self._trim()

    def forget(self, first: BlockKey, count: int) -> None:
        """Drop remembered checksums that disagreed with the data: either may have been damaged."""
        for blockno in range(first.blockno, first.blockno + count):
            self._known.pop((first.file_id, first.version, blockno), None)

    async def _load_span(self, file_id: bytes, version: bytes, span: int) -> None:
        flight_key = (file_id, version, span)
        event = self._spans_in_flight.get(flight_key)
        if event is not None:
            await event.wait()  # the other task's failure shows up as missing checksums
            return
        event = self._spans_in_flight[flight_key] = trio.Event()
        try:
            first = span * self._span_blocks
            sums = await self._client.get_checksums(
                file_id.hex(), version.hex(), self._block_size, first, self._span_blocks
            )
            for offset, checksum in enumerate(sums):
                self._known[(file_id, version, first + offset)] = checksum
            self._trim()
        finally:
            del self._spans_in_flight[flight_key]
            event.set()

    def _trim(self) -> None:
        while len(self._known) > REMEMBERED:
            self._known.popitem(last=False)
