"""Requests to the hub for block data, each checked against the hub's checksums and retried with backoff until a deadline."""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import trio
import xxhash

from ..buffers import Buffer
from ..cache import BlockKey
from ..errors import HubError, HubProtocolError, HubStatusError, HubUnavailable, RemoteFileChanged
from ..metrics import FETCH_DURATION, Stats
from .hub import BlockHub
from .hub_checksums import BlockChecksums

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# Runs of up to this many blocks (the hub's limit) ask for their checksums in
# the data answer's header: the hub hashes just those blocks (and so reads
# them into its page cache for the send) instead of a span of 64 before
# answering a checksums request the data waits for.
HEADER_SUMS_BLOCKS = 64

# Takes each block of a ranged answer once it has passed its check: (index in the range, bytes).
VerifiedSink = Callable[[int, Buffer], Awaitable[None]]


class VerifiedRequests:
    """Ranged and batch requests whose every block is checked; failures retried until a deadline."""

    def __init__(self, client: BlockHub, stats: Stats, *, block_size: int, fetch_timeout_s: float) -> None:
        self._client = client
        self._stats = stats
        self._block_size = block_size
        self._fetch_timeout_s = fetch_timeout_s
        self._checksums = BlockChecksums(client, block_size)
        self._sums_in_header = True  # until the hub refuses it (400): then checksum requests
        self.requests_in_flight = 0

    async def range(
        self, key: BlockKey, start: int, lengths: list[int], on_verified: VerifiedSink | None = None
    ) -> list[Buffer]:
        """One attempt: the data, checked against the hub's checksums of it.

        The checksums come from memory, or in the data answer's header (a
        hub that sent them only for some of the blocks, as a cache answering
        from slices may, is asked for the rest), or from a checksum request
        side by side with the data (a hub that refuses them in the header).

        With `on_verified`, each block is awaited into it, in order, as soon
        as it has arrived and passed its check (where its checksum came
        before its bytes), and none is returned: a run then holds one
        block in memory, not all of them, and its readers need not wait for
        the rest. A block whose checksum is not known yet waits, with the
        blocks after it, until it is.
        """
        count = len(lengths)
        expected = self._checksums.known(key, count)
        if on_verified is not None:
            on_verified = self._counted(on_verified)
        if on_verified is not None and (expected is not None or (count <= HEADER_SUMS_BLOCKS and self._sums_in_header)):
            try:
                await self._streamed(key, start, lengths, expected, on_verified)
                return []
            except HubStatusError as exc:
                if exc.status != 400 or expected is not None:
                    raise
                log.warning("the hub does not send checksums with data (an older hub?): asking for them apart")
                self._sums_in_header = False
        pieces = await self._checked(key, start, lengths, expected)
        if on_verified is None:
            return pieces
        for index, piece in enumerate(pieces):
            await on_verified(index, piece)
        return []

    def _counted(self, on_verified: VerifiedSink) -> VerifiedSink:
        """`on_verified`, counting the bytes it gets as fetched (`with_retries` counts those returned)."""

        async def counted(index: int, piece: Buffer) -> None:
            self._stats.fetched_bytes += len(piece)
            await on_verified(index, piece)

        return counted

    async def _checked(self, key: BlockKey, start: int, lengths: list[int], expected: list[int] | None) -> list[Buffer]:
        """The data of `range`, all of it received before any is checked."""
        count = len(lengths)
        if expected is not None:
            pieces, _ = await self._client.get_range(key.file_id.hex(), key.version.hex(), start, lengths)
        elif count <= HEADER_SUMS_BLOCKS and self._sums_in_header:
            try:
                pieces, sums = await self._client.get_range(
                    key.file_id.hex(), key.version.hex(), start, lengths, sums_block_size=self._block_size
                )
            except HubStatusError as exc:
                if exc.status != 400:
                    raise
                log.warning("the hub does not send checksums with data (an older hub?): asking for them apart")
                self._sums_in_header = False
                pieces, expected = await self._data_and_sums(key, start, lengths)
            else:
                self._checksums.remember(key, sums)
                expected = self._checksums.known(key, count) or await self._checksums.expected(key, count)
        else:
            pieces, expected = await self._data_and_sums(key, start, lengths)
        offset = self._first_mismatch(pieces, expected)
        if offset is not None:
            self._checksums.forget(key, count)
            raise HubProtocolError(f"block {key.blockno + offset} of file {key.file_id.hex()} failed its checksum")
        return pieces

    async def _streamed(
        self, key: BlockKey, start: int, lengths: list[int], expected: list[int] | None, on_verified: VerifiedSink
    ) -> None:
        """The data of `range`, each block checked and handed on as it arrives (see `range`)."""
        count = len(lengths)
        waiting: list[tuple[int, Buffer]] = []  # arrived, behind a block whose checksum is not known yet

        def check(index: int, piece: Buffer, checksum: int) -> None:
            if self._first_mismatch([piece], [checksum]) is not None:
                self._checksums.forget(key, count)
                raise HubProtocolError(f"block {key.blockno + index} of file {key.file_id.hex()} failed its checksum")

        async def arrived(index: int, piece: Buffer, sums: dict[int, int]) -> None:
            if index == 0:
                waiting.clear()  # a source asked again after one failed part way starts afresh
            checksum = expected[index] if expected is not None else sums.get(key.blockno + index)
            if checksum is None or waiting:
                waiting.append((index, piece))
                return
            check(index, piece, checksum)
            await on_verified(index, piece)

        _, sums = await self._client.get_range(
            key.file_id.hex(), key.version.hex(), start, lengths,
            sums_block_size=self._block_size if expected is None else None, on_piece=arrived,
        )
        if expected is None:
            self._checksums.remember(key, sums)
        if not waiting:
            return
        if expected is None:
            expected = self._checksums.known(key, count) or await self._checksums.expected(key, count)
        for index, piece in waiting:
            check(index, piece, expected[index])
            await on_verified(index, piece)

    async def batch(
        self, keys: Sequence[BlockKey], lengths: Sequence[int], verified: Callable[[int, Buffer], Awaitable[None]]
    ) -> list[Buffer]:
        """One attempt at a batch of whole small files, each checked against the hub's checksum
        and awaited into `verified` (with its index) as soon as it has arrived; none is returned."""
        counted = self._counted(verified)

        async def arrived(index: int, piece: Buffer, checksum: int) -> None:
            if self._first_mismatch([piece], [checksum]) is not None:
                raise HubProtocolError(f"file {keys[index].file_id.hex()} of a batch failed its checksum")
            await counted(index, piece)

        files = [(key.file_id.hex(), key.version.hex()) for key in keys]
        await self._client.get_batch(files, lengths, self._block_size, arrived)
        return []

    def _first_mismatch(self, pieces: list[Buffer], expected: Sequence[int]) -> int | None:
        """The index of the first piece whose xxh3 is not the hub's (counted as an integrity failure), or None."""
        for index, (piece, checksum) in enumerate(zip(pieces, expected, strict=True)):
            if xxhash.xxh3_64_intdigest(piece) != checksum:
                self._stats.integrity_failures += 1
                return index
        return None

    async def _data_and_sums(self, key: BlockKey, start: int, lengths: list[int]) -> tuple[list[Buffer], list[int]]:
        """The data request and the checksum request, side by side (no extra round trip)."""
        results: dict[str, Any] = {}

        async def get(name: str, request: Callable[[], Awaitable[Any]]) -> None:
            try:
                results[name] = await request()
            except HubError as exc:
                results.setdefault("error", exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, "sums", lambda: self._checksums.expected(key, len(lengths)))
            nursery.start_soon(
                get, "pieces", lambda: self._client.get_range(key.file_id.hex(), key.version.hex(), start, lengths)
            )
        if "error" in results:
            raise results["error"]
        return results["pieces"][0], results["sums"]

    async def with_retries(
        self,
        key: BlockKey,
        attempt_once: Callable[[], Awaitable[list[Buffer]]],
        deadline: float | Deadline | None = None,
    ) -> list[Buffer]:
        """`attempt_once()` until it succeeds or `deadline` (by default `fetch_timeout_s` from
        now) has passed (`key` names it in logs)."""
        if deadline is None:
            deadline = trio.current_time() + self._fetch_timeout_s
        if not isinstance(deadline, Deadline):
            deadline = Deadline(deadline)
        backoff_s = FIRST_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            started = trio.current_time()
            self.requests_in_flight += 1
            try:
                with deadline.attempt():
                    pieces = await attempt_once()
                self._stats.fetches += 1
                self._stats.fetched_bytes += sum(len(piece) for piece in pieces)
                FETCH_DURATION.observe(trio.current_time() - started)
                return pieces
            except trio.TooSlowError:
                self._stats.hub_errors["timeout"] += 1
                error: HubError = HubUnavailable(f"hub did not deliver {key} within {self._fetch_timeout_s:g} s")
            except HubUnavailable as exc:
                self._stats.hub_errors["connection"] += 1
                error = exc
            except HubProtocolError as exc:
                self._stats.hub_errors["protocol"] += 1
                error = exc
            except RemoteFileChanged:
                self._stats.hub_errors["changed"] += 1
                self._stats.fetch_failures += 1
                raise
            except HubStatusError as exc:
                self._stats.hub_errors[f"http_{exc.status // 100}xx"] += 1
                if not exc.retryable:
                    self._stats.fetch_failures += 1
                    raise
                error = exc
            finally:
                self.requests_in_flight -= 1
            pause_s = random.uniform(0, backoff_s)  # full jitter
            if trio.current_time() + pause_s >= deadline.at:
                log.warning("giving up on %s after %d attempts: %s", key, attempt, error)
                self._stats.fetch_failures += 1
                raise error
            log.info("fetching %s failed (%s); retry %d in %.2f s", key, error, attempt, pause_s)
            self._stats.fetch_retries += 1
            await trio.sleep(pause_s)
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)


class Deadline:
    """When a fetch gives up (trio's clock): put off by the time its attempts wait for the
    spoke's own side (`paused`: the cache writer's room), which says nothing about the hub."""

    def __init__(self, at: float) -> None:
        self.at = at
        self._scope: trio.CancelScope | None = None  # the attempt under way

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """One attempt, failed with trio.TooSlowError at the deadline."""
        with trio.fail_at(self.at) as scope:
            self._scope = scope
            try:
                yield
            finally:
                self._scope = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A wait within the attempt that does not count against the deadline."""
        scope = self._scope
        started = trio.current_time()
        if scope is not None:
            scope.deadline = math.inf
        try:
            yield
        finally:
            self.at += trio.current_time() - started
            if scope is not None:
                scope.deadline = self.at


def passing(error: HubError) -> bool:
    """Whether a failure may be gone on a later try (the ones fetches retry)."""
    if isinstance(error, HubStatusError):
        return error.retryable
    return isinstance(error, (HubUnavailable, HubProtocolError))
