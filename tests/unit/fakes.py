"""A fake hub for policy tests: serves files from memory through the fetch layer's `BlockHub`
Protocol, logs every request, and can be slow, fail or go silent (in trio's clock: a test
with MockClock runs it without waiting)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Awaitable, Callable, Sequence

import trio
import xxhash

from cachefs.errors import BatchUnsupported, HubError, HubProtocolError, HubUnavailable
from cachefs.fetch.hub import PieceSink

FileKey = tuple[str, str]  # (file id, version), hex as on the wire


@dataclasses.dataclass(frozen=True)
class HubRequest:
    """One request the fake hub answered, failed or left unanswered."""

    kind: str  # "range", "batch" or "checksums"
    file_ids: tuple[str, ...]
    start: int  # range: first byte; checksums: first block
    lengths: tuple[int, ...]  # range and batch: the pieces' lengths; checksums: (count,)
    at_s: float  # trio's clock when it arrived

    def blocks(self, block_size: int) -> list[int]:
        """The block numbers a range request asked for."""
        first = self.start // block_size
        return list(range(first, first + len(self.lengths)))


class FakeHub:
    """Files (id, version) -> bytes in memory, answered as HubClient would, with the hub's
    xxh3-64 checksums of each block."""

    def __init__(self, files: dict[FileKey, bytes] | None = None) -> None:
        self.files: dict[FileKey, bytes] = dict(files or {})
        self.requests: list[HubRequest] = []
        self.bytes_sent = 0
        self.delay_s = 0.0  # before each answer (trio's clock)
        self.piece_delay_s = 0.0  # before each piece of a ranged answer taken piece by piece
        self.pieces_sent = 0  # pieces of ranged answers handed to their taker
        self._breaks: list[int] = []  # the next ranged answers break after this many pieces
        self.silent = False  # take requests, answer none
        self.batches = True
        self._failures: list[Callable[[], HubError]] = []
        self._corrupt_answers = 0

    # -- behaviour ---------------------------------------------------------------------

    def fail_next(self, count: int, error: Callable[[], HubError] = lambda: HubUnavailable("fake hub: connection reset")
                  ) -> None:
        """The next `count` data requests fail with `error()`."""
        self._failures += [error] * count

    def break_next_after(self, pieces: int) -> None:
        """The next ranged answer taken piece by piece sends `pieces` pieces, then the connection breaks."""
        self._breaks.append(pieces)

    def fail_always(self, error: Callable[[], HubError] = lambda: HubUnavailable("fake hub: connection refused")
                    ) -> None:
        self._failures = [error] * 1_000_000

    def corrupt_next(self, count: int) -> None:
        """The next `count` data answers have a bit flipped (their checksums stay the hub's)."""
        self._corrupt_answers += count

    # -- what the tests read -------------------------------------------------------------

    def ranges(self) -> list[HubRequest]:
        return [request for request in self.requests if request.kind == "range"]

    def blocks_asked(self, file_id: bytes, block_size: int) -> list[int]:
        """Block numbers of the file asked for in range requests, in request order (repeats kept)."""
        return [blockno for request in self.ranges() if request.file_ids == (file_id.hex(),)
                for blockno in request.blocks(block_size)]

    # -- BlockHub ------------------------------------------------------------------------

    async def get_range(
        self,
        file_id: str,
        version: str,
        start: int,
        lengths: Sequence[int],
        *,
        sums_block_size: int | None = None,
        on_piece: PieceSink | None = None,
    ) -> tuple[list[bytearray], dict[int, int]]:
        await self._arrive("range", (file_id,), start, tuple(lengths))
        data = self.files[(file_id, version)]
        pieces, offset = [], start
        for length in lengths:
            if offset + length > len(data):
                raise HubProtocolError(f"fake hub: {file_id} has no bytes {offset}+{length}")
            pieces.append(bytearray(data[offset : offset + length]))
            offset += length
        self._maybe_corrupt(pieces)
        self.bytes_sent += sum(lengths)
        sums = {}
        if sums_block_size is not None:  # the blocks the range covers whole
            first, stop = -(-start // sums_block_size), (start + sum(lengths)) // sums_block_size
            if start + sum(lengths) == len(data):
                stop = -(-len(data) // sums_block_size)
            sums = {blockno: checksum(data, blockno, sums_block_size) for blockno in range(first, stop)}
        if on_piece is None:
            return pieces, sums
        breaks_after = self._breaks.pop(0) if self._breaks else None
        for index, piece in enumerate(pieces):
            if index == breaks_after:
                raise HubUnavailable("fake hub: connection reset part way through an answer")
            if self.piece_delay_s:
                await trio.sleep(self.piece_delay_s)
            self.pieces_sent += 1
            await on_piece(index, piece, sums)
        return [], sums

    async def get_batch(
        self,
        files: Sequence[tuple[str, str]],
        lengths: Sequence[int],
        block_size: int,
        on_file: Callable[[int, bytearray, int], Awaitable[None]],
    ) -> None:
        if not self.batches:
            raise BatchUnsupported("fake hub: no batches")
        await self._arrive("batch", tuple(file_id for file_id, _v in files), 0, tuple(lengths))
        pieces = [bytearray(self.files[file]) for file in files]
        self._maybe_corrupt(pieces)
        for index, piece in enumerate(pieces):
            self.bytes_sent += len(piece)
            await on_file(index, piece, xxhash.xxh3_64_intdigest(self.files[files[index]]))

    async def get_checksums(self, file_id: str, version: str, block_size: int, first: int, count: int) -> list[int]:
        self.requests.append(HubRequest("checksums", (file_id,), first, (count,), trio.current_time()))
        data = self.files[(file_id, version)]
        stop = min(first + count, -(-len(data) // block_size))
        return [checksum(data, blockno, block_size) for blockno in range(first, stop)]

    async def _arrive(self, kind: str, file_ids: tuple[str, ...], start: int, lengths: tuple[int, ...]) -> None:
        """Log a data request, then wait, fail or stay silent as told."""
        self.requests.append(HubRequest(kind, file_ids, start, lengths, trio.current_time()))
        if self.silent:
            await trio.sleep_forever()
        if self.delay_s:
            await trio.sleep(self.delay_s)
        if self._failures:
            raise self._failures.pop(0)()

    def _maybe_corrupt(self, pieces: list[bytearray]) -> None:
        if self._corrupt_answers and pieces and pieces[0]:
            self._corrupt_answers -= 1
            pieces[0][0] ^= 1


def checksum(data: bytes, blockno: int, block_size: int) -> int:
    return xxhash.xxh3_64_intdigest(data[blockno * block_size : (blockno + 1) * block_size])


def file_id_of(path: str) -> bytes:
    """The hub's id of a file: the xxh3-64 of its path (as the namespace checks)."""
    return xxhash.xxh3_64_intdigest(os.fsencode(path)).to_bytes(8, "big")
