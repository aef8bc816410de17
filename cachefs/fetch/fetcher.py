"""Fetch blocks from the hub: single-flight, priorities, verified, bounded retries, group-committed caching.

Every block being fetched has a *flight*; concurrent readers of it wait on
the same flight, so a block is requested once. A run of contiguous blocks
is fetched with one ranged request. Fetches retry connection failures,
timeouts, truncated bodies and 5xx answers with exponential backoff and
jitter until `fetch_timeout_s` has passed, then fail. Every block is
checked against the hub's checksum of it (hub_checksums.py; for a run of up to
HEADER_SUMS_BLOCKS blocks, sent in the data answer's header: verified.py); a
mismatch is retried like a broken connection.

Each caller has its own entry point: `fetch` (a demand miss), `read_ahead`
and `read_ahead_files` (read-ahead), `plan_prefetch` (a loader's plan) and
`warm` (an operator's warm-up). All but `fetch` run at prefetch priority,
within `prefetch_slots`, so demand misses always find a connection. Small
files prefetched together are asked for in one batch request
(hubserver/batch.py), each checked like a block and handed over as soon as
it has arrived, before the rest of the batch.

A fetched block's bytes go to the held-block store (read/held.py) under
their caller's owner tag, where readers of its flight find them, and to a
single cache writer task that commits them in batches (one fsync per
batch, not per block); a flight stays visible until its block is
committed, so no reader fetches a block that is on its way to disk. A
prefetch run goes there block by block as its answer arrives, and receives
its next block only once the writer has room: however much is in flight,
the bytes fetched and not yet written stay within the write queue's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence

import trio

from ..buffers import Buffer
from ..cache import BlockCache, BlockData, BlockKey
from ..config import MemoryBudget
from ..errors import (
    BatchUnsupported,
    FetchAbandoned,
    HubError,
    RemoteFileChanged,
)
from ..metrics import Stats
from ..read.claims import ReadAheadClaims
from ..read.held import HeldBlocks, HoldNote, Owner
from .byte_budget import ByteBudget
from .hub import BlockHub
from .verified import FIRST_BACKOFF_S, Deadline, VerifiedRequests, passing

log = logging.getLogger(__name__)

# How long the cache writer waits for more blocks when it finds a single one
# queued: at 1 Gbit/s a batch fills (write_batch_bytes) within it, so a slow
# link costs one commit per 8 MiB, as a fast one does. Readers are served
# from the held blocks meanwhile (docs/data-path.md has the measurements).
WRITE_GATHER_S = 0.1


class Flight:
    """One block being fetched (and then written); waiters use `done`, then find its bytes held."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.handed_over = False  # its bytes reached the held-block store
        self.error: HubError | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Request:
    """Who asked for a fetch, which decides how its blocks are held and admitted."""

    owner: Owner
    notes: Sequence[HoldNote] | None = None  # one per block (plan prefetch)

    @property
    def force_admission(self) -> bool:
        """An operator's warm-up caches its blocks even where admission prefers what the cache holds."""
        return self.owner is Owner.WARM

    def note(self, index: int) -> HoldNote | None:
        return self.notes[index] if self.notes is not None else None

    def only(self, index: int) -> _Request:
        """This request for its `index`th block alone."""
        return self if self.notes is None else _Request(self.owner, (self.notes[index],))


# A block on its way to the cache: its key, bytes, and whether its admission is forced.
_Written = tuple[BlockKey, BlockData, bool]

_DEMAND = _Request(Owner.DEMAND)
_READ_AHEAD = _Request(Owner.READ_AHEAD)
_WARM = _Request(Owner.WARM)


class Fetcher:
    """Gets blocks from the hub, holds their bytes (HeldBlocks) and hands them to the cache writer."""

    def __init__(
        self,
        client: BlockHub,
        cache: BlockCache,
        held: HeldBlocks,
        claims: ReadAheadClaims,
        stats: Stats,
        *,
        budget: MemoryBudget,
        fetch_timeout_s: float,
        prefetch_connections: int,
    ) -> None:
        self._requests = VerifiedRequests(
            client, stats, block_size=budget.block_size_bytes, fetch_timeout_s=fetch_timeout_s)
        self.batches = True  # small files in batches, until the hub refuses one: then one by one
        self._cache = cache
        self._held = held
        # Blocks read ahead and not read yet: admission counts their coming read.
        self._claims = claims
        self._stats = stats
        self._fetch_timeout_s = fetch_timeout_s
        self._flights: dict[BlockKey, Flight] = {}
        self._discarded: set[BlockKey] = set()
        self._batch_written = trio.Event()  # set (and replaced) after each committed batch
        self._readahead_fetching_bytes = 0  # of read-ahead's requests, from asking until all of a run is queued to write
        self.prefetch_slots = trio.CapacityLimiter(max(1, prefetch_connections))
        self._write_batch_bytes = budget.write_batch_bytes
        self._write_room = ByteBudget(budget.write_queue_bytes)
        self._write_send, self._write_receive = trio.open_memory_channel[_Written](math.inf)

    async def writer_backlog_below(self, fetches: int) -> None:
        """Wait until fewer than `fetches` fetches hold fetched blocks that wait for the cache
        writer's room (each holds its bytes meanwhile)."""
        await self._write_room.wait_for_fewer_waiting(fetches)

    @contextlib.asynccontextmanager
    async def prefetch_slot(self, writer_backlog_below: int) -> AsyncIterator[None]:
        """One of `prefetch_slots`, held only while fewer than `writer_backlog_below` fetches
        wait for the cache writer's room (read-ahead: more runs would only wait in memory).
        It waits for the writer without a slot: the plan's prefetch and sibling batches
        keep the connections meanwhile."""
        while True:
            await self.writer_backlog_below(writer_backlog_below)
            await self.prefetch_slots.acquire()
            if self._write_room.waiting < writer_backlog_below:
                break
            self.prefetch_slots.release()  # the backlog grew while this waited for the slot
        try:
            yield
        finally:
            self.prefetch_slots.release()

    def write_backlog(self) -> tuple[int, int]:
        """The cache writer's backlog: bytes queued for it or being written, and fetches that
        hold fetched bytes while they wait for its room (the metrics' gauges)."""
        return self._write_room.taken, self._write_room.waiting

    def readahead_memory_bytes(self) -> int:
        """Bytes read-ahead holds: its runs from asking until their last block is queued for the
        cache writer, and blocks fetched ahead and held for their first read (plan prefetch,
        which counts its own, and warm-ups are not in it)."""
        return self._readahead_fetching_bytes + self._held.bytes_of(Owner.READ_AHEAD, writing=False)

    @contextlib.contextmanager
    def _readahead_fetching(self, lengths: Sequence[int]) -> Iterator[None]:
        size = sum(lengths)
        self._readahead_fetching_bytes += size
        try:
            yield
        finally:
            self._readahead_fetching_bytes -= size

    @property
    def requests_in_flight(self) -> int:
        """Requests to the hub under way (a gauge)."""
        return self._requests.requests_in_flight

    def flight(self, key: BlockKey) -> Flight | None:
        """The block's flight if it is being fetched or written."""
        return self._flights.get(key)

    def in_flight_or_cached(self, key: BlockKey) -> bool:
        return key in self._flights or self._cache.contains(key)

    def deadline(self) -> float:
        """When a read that starts waiting now gives up (`fetch_timeout_s` from now, trio's clock)."""
        return trio.current_time() + self._fetch_timeout_s

    async def fetch(self, key: BlockKey, start: int, length: int, deadline: float | None = None) -> BlockData:
        """A demand miss of a block with no flight under way (BlockSource joins those): its bytes
        (raises HubError when they cannot be had by `deadline`, by default `fetch_timeout_s` from now)."""
        under_way = self._flights.get(key)
        if under_way is not None and not under_way.done.is_set():
            raise ValueError(f"{key} is already in flight: join it")
        flight = self._flights[key] = Flight()
        attempt = functools.partial(self._requests.range, key, start, [length])
        pieces = await self._run([key], [flight], attempt, _DEMAND, deadline=deadline)
        if pieces is None:
            assert flight.error is not None
            raise flight.error
        return pieces[0]

    async def join(self, key: BlockKey, flight: Flight, deadline: float) -> BlockData | None:
        """The bytes of a fetch under way, for a reader that must have them by `deadline`.

        None when the reader should fetch the block itself: the fetch's task
        went away (a cancelled warm-up or prefetch never fails its readers),
        its bytes are no longer held, or the fetch gave up on a passing
        failure (hub down, timeouts, 5xx) while the reader's own time is not
        over: a read that joins a fetch late gets its whole fetch timeout, not
        what was left of that fetch's. A changed file or a refused request
        fails the reader at once.
        """
        await flight.done.wait()
        error = flight.error
        if error is None:
            return self._held.use(key, trio.current_time())
        if isinstance(error, FetchAbandoned):
            return None
        if passing(error) and deadline - trio.current_time() >= FIRST_BACKOFF_S:
            return None
        raise error

    async def read_ahead(self, keys: Sequence[BlockKey], start: int, lengths: Sequence[int]) -> bool:
        """Read-ahead of contiguous blocks with one request; False if it failed.

        The caller holds one of `prefetch_slots` and has filtered out blocks
        that are cached or in flight. Failures settle the flights (a reader
        then retries on demand) and are not raised. The blocks are claimed
        (admission counts their coming read) and held until that read.
        """
        flights = self._new_flights(keys, claim=True)
        with self._readahead_fetching(lengths):
            return await self._run_streamed(keys, flights, start, lengths, _READ_AHEAD)

    async def plan_prefetch(
        self, keys: Sequence[BlockKey], start: int, lengths: Sequence[int], notes: Sequence[HoldNote]
    ) -> bool:
        """A plan's prefetch of contiguous blocks with one request (as `read_ahead`); each block
        is held for its planned use, which its note in `notes` follows."""
        flights = self._new_flights(keys, claim=False)
        return await self._run_streamed(keys, flights, start, lengths, _Request(Owner.PLAN, tuple(notes)))

    async def warm(self, keys: Sequence[BlockKey], start: int, lengths: Sequence[int]) -> bool:
        """An operator's warm-up of contiguous blocks with one request (as `read_ahead`): cached
        even where the admission policy would prefer what the cache holds, held only until written."""
        flights = self._new_flights(keys, claim=False)
        return await self._run_streamed(keys, flights, start, lengths, _WARM)

    async def read_ahead_files(self, keys: Sequence[BlockKey], lengths: Sequence[int]) -> bool:
        """Read-ahead of small files whole (block 0 of each, the whole file), with one batch
        request while the hub takes them; False if it failed. The caller holds one of
        `prefetch_slots`.

        If one of them changed on the hub (412), they are asked for one by
        one, so that only the changed one fails. A hub that does not know
        batches (an older one) is asked one by one from then on.
        """
        with self._readahead_fetching(lengths):
            return await self._files(keys, self._new_flights(keys, claim=True), lengths, _READ_AHEAD)

    async def plan_prefetch_files(self, keys: Sequence[BlockKey], lengths: Sequence[int],
                                  notes: Sequence[HoldNote]) -> bool:
        """A plan's prefetch of small files whole, with one batch request (as `read_ahead_files`);
        each file is held for its planned use, which its note in `notes` follows."""
        request = _Request(Owner.PLAN, tuple(notes))
        return await self._files(keys, self._new_flights(keys, claim=False), lengths, request)

    async def _files(self, keys: Sequence[BlockKey], flights: list[Flight], lengths: Sequence[int],
                     request: _Request) -> bool:
        """Small files whole (block 0 of each), with one batch request while the hub takes them."""
        queued: set[int] = set()
        if self.batches:
            try:
                return await self._batch_streamed(keys, flights, lengths, queued, request)
            except RemoteFileChanged:
                pass  # one of them changed: asking one by one tells which
            except BatchUnsupported as exc:
                log.warning("no batches of small files from this hub (%s): asking for them one by one", exc)
                self.batches = False
        rest = _not_in(queued, len(keys))
        return await self._files_one_by_one(
            [keys[index] for index in rest], [flights[index] for index in rest], [lengths[index] for index in rest],
            [request.only(index) for index in rest],
        )

    async def _batch_streamed(
        self, keys: Sequence[BlockKey], flights: list[Flight], lengths: Sequence[int], queued: set[int],
        request: _Request,
    ) -> bool:
        """Small files with one batch request (retried until `fetch_timeout_s` from now), each
        handed over and then queued for the cache writer as soon as it has arrived and been
        checked, as a run's blocks are: the next file is received only once the writer has
        room for this one, so a batch holds one file in memory, not all of them. A retry asks
        only for the files not queued yet (`queued`: their indexes). False on failure; a changed
        file or a hub without batches raises, with the flights of the files not queued open."""
        deadline = Deadline(trio.current_time() + self._fetch_timeout_s)  # waits for the writer do not count

        def fail_rest(error: HubError) -> None:
            rest = _not_in(queued, len(keys))
            self._fail([keys[index] for index in rest], [flights[index] for index in rest], error)

        async def attempt() -> list[Buffer]:
            rest = _not_in(queued, len(keys))
            if not rest:
                return []

            async def verified(position: int, data: Buffer) -> None:
                index = rest[position]
                await self._hand_over_and_queue(keys[index], flights[index], data, request, index, deadline)
                queued.add(index)

            return await self._requests.batch([keys[index] for index in rest], [lengths[index] for index in rest], verified)

        try:
            await self._requests.with_retries(keys[0], attempt, deadline)
        except (RemoteFileChanged, BatchUnsupported):
            raise
        except HubError as exc:
            fail_rest(exc)
            return False
        except BaseException:  # cancelled: what is not queued is neither cached nor in flight
            fail_rest(FetchAbandoned(f"fetch of {keys[0]} was cancelled"))
            raise
        return True

    async def _files_one_by_one(self, keys: Sequence[BlockKey], flights: list[Flight], lengths: Sequence[int],
                                requests: Sequence[_Request]) -> bool:
        """Small files with one request each, side by side (one round trip, not one per file)
        within `prefetch_slots`: one request at a time on the caller's slot, and one on each
        slot free. False if any failed.

        The batch's flights end first (FetchAbandoned): a file gets a flight again only
        when its request starts, so a reader never waits for a request queued behind
        read-ahead or a plan's prefetch; it fetches the file itself (and the requests
        here skip it). `requests` says whose each file is (a plan's: its hold note).
        """
        self._fail(list(keys), flights, FetchAbandoned(f"batch of {keys[0]} and others asked for one by one"))
        files = iter(zip(keys, lengths, requests, strict=True))
        failed: list[BlockKey] = []

        async def requester(slot: contextlib.AbstractAsyncContextManager[object]) -> None:
            while True:
                async with slot:
                    key, length, request = next(((k, n, r) for k, n, r in files if not self.in_flight_or_cached(k)),
                                                (None, 0, _READ_AHEAD))
                    if key is None:
                        return
                    flight = self._flights[key] = Flight()
                    attempt = functools.partial(self._requests.range, key, 0, [length])
                    if await self._run([key], [flight], attempt, request) is None:
                        failed.append(key)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(requester, contextlib.nullcontext())  # the caller's slot
            for _ in range(min(len(keys), int(self.prefetch_slots.total_tokens)) - 1):
                nursery.start_soon(requester, self.prefetch_slots)
        return not failed

    def _new_flights(self, keys: Sequence[BlockKey], claim: bool) -> list[Flight]:
        """New flights for blocks about to be prefetched (`claim`: by read-ahead)."""
        flights = []
        now = trio.current_time()
        for key in keys:
            if key in self._flights:
                raise ValueError(f"{key} is already in flight")
            flights.append(self._flights.setdefault(key, Flight()))
            if claim:
                self._claims.add(key, now)
        return flights

    async def written(self, keys: set[BlockKey], timeout_s: float = 60.0) -> None:
        """Wait (bounded) until none of these blocks is still on its way to the cache."""
        with trio.move_on_after(timeout_s):
            while any(key in self._flights for key in keys):
                await self._batch_written.wait()

    def discard_pending(self, predicate: Callable[[BlockKey], bool]) -> None:
        """Blocks that match are dropped from memory, and those in flight are neither written
        to the cache nor held once written (evict, purge)."""
        self._discarded.update(key for key in self._flights if predicate(key))
        self._held.discard(predicate)

    async def _run(
        self,
        keys: list[BlockKey],
        flights: list[Flight],
        attempt: Callable[[], Awaitable[list[Buffer]]],
        request: _Request,
        deadline: float | None = None,
    ) -> list[Buffer] | None:
        """Fetch `keys` with `attempt` (retried until `deadline`, by default `fetch_timeout_s`
        from now) and settle their flights; the blocks' bytes, None on failure."""
        try:
            pieces = await self._requests.with_retries(keys[0], attempt, deadline)
        except HubError as exc:
            self._fail(keys, flights, exc)
            return None
        except BaseException:
            self._fail(keys, flights, FetchAbandoned(f"fetch of {keys[0]} was cancelled"))
            raise
        await self._settle(keys, flights, pieces, request)
        return pieces

    async def _run_streamed(
        self, keys: Sequence[BlockKey], flights: list[Flight], start: int, lengths: Sequence[int], request: _Request
    ) -> bool:
        """Fetch contiguous blocks with one request (retried until `fetch_timeout_s` from now),
        each block handed over and then queued for the cache writer as soon as it has
        arrived and been checked; False on failure.

        The next block is received only once the writer has room for this one
        (back-pressure on the connection): what a run holds in memory is one
        block and the write queue, however many bytes it has in flight. A
        retry asks only for the blocks not queued yet.
        """
        offsets = list(itertools.accumulate(lengths, initial=start))
        queued = 0  # blocks queued for the cache writer: a prefix of the run (they arrive in order)
        deadline = Deadline(trio.current_time() + self._fetch_timeout_s)  # waits for the writer do not count

        async def attempt() -> list[Buffer]:
            first = queued
            if first == len(keys):
                return []

            async def verified(index: int, data: Buffer) -> None:
                nonlocal queued
                position = first + index
                if position < queued:
                    return  # queued already (a source failed part way and another sends it again)
                await self._hand_over_and_queue(keys[position], flights[position], data, request, position, deadline)
                queued = position + 1

            return await self._requests.range(keys[first], offsets[first], list(lengths[first:]), verified)

        try:
            await self._requests.with_retries(keys[0], attempt, deadline)
        except HubError as exc:
            self._fail(list(keys[queued:]), flights[queued:], exc)
            return False
        except BaseException:  # cancelled: what is not queued is neither cached nor in flight
            self._fail(list(keys[queued:]), flights[queued:], FetchAbandoned(f"fetch of {keys[0]} was cancelled"))
            raise
        return True

    async def _settle(self, keys: list[BlockKey], flights: list[Flight], pieces: list[Buffer], request: _Request) -> None:
        """Hand fetched blocks over (those not handed over already), then to the cache writer,
        as its room allows: readers waiting for a flight never wait for the disk; the task
        that fetched it does (back-pressure: fetching never runs more than the write queue's
        bytes ahead of the cache's disk, which bounds the memory they hold)."""
        for index, (key, flight, data) in enumerate(zip(keys, flights, pieces, strict=True)):
            self._hand_over(key, flight, data, request, index)
        queued = 0
        try:
            for key, data in zip(keys, pieces, strict=True):
                await self._write_room.take(len(data))
                self._write_send.send_nowait((key, data, request.force_admission))
                queued += 1
        except BaseException:  # cancelled while waiting for room: the rest are not cached, nor in flight
            for key, flight in zip(keys[queued:], flights[queued:], strict=True):
                self._forget(key, flight)
            raise

    async def _hand_over_and_queue(
        self, key: BlockKey, flight: Flight, data: BlockData, request: _Request, index: int, deadline: Deadline
    ) -> None:
        """A streamed block (or small file) that passed its check: handed over, then queued for the
        cache writer once it has room (that wait does not count against the fetch's `deadline`)."""
        self._hand_over(key, flight, data, request, index)
        with deadline.paused():
            await self._write_room.take(len(data))
        self._write_send.send_nowait((key, data, request.force_admission))

    def _hand_over(self, key: BlockKey, flight: Flight, data: BlockData, request: _Request, index: int) -> None:
        """A block's verified bytes into the held-block store, for whoever waits for it, once."""
        if flight.done.is_set():
            return
        self._held.arrived(key, data, request.owner, trio.current_time(), request.note(index))
        flight.handed_over = True
        flight.done.set()

    def _fail(self, keys: list[BlockKey], flights: list[Flight], error: HubError) -> None:
        """End flights without a result (a flight handed its bytes over already keeps them, uncached)."""
        for key, flight in zip(keys, flights, strict=True):
            if not flight.done.is_set():
                flight.error = error
                flight.done.set()
            self._forget(key, flight)

    def _forget(self, key: BlockKey, flight: Flight) -> None:
        """A flight that will not reach the cache writer (failed, or cancelled before its turn):
        the next fetch of its block starts afresh, and an evict's mark meant this one's bytes."""
        if self._flights.get(key) is flight:
            del self._flights[key]
            if flight.handed_over:
                self._settled(key, cached=False)
            self._discarded.discard(key)

    def _settled(self, key: BlockKey, cached: bool) -> None:
        self._held.settled(key, trio.current_time(), cached=cached, claimed=key in self._claims,
                           discarded=key in self._discarded)

    async def _gather_batch(self, first: _Written) -> list[_Written]:
        """The blocks the writer commits together: those queued behind `first`, up to
        `write_batch_bytes`. If none were, the link is slower than the disk and
        delivers a block at a time: gathering for a moment then makes one commit (one
        fsync, one worker hand-off) of several blocks, not one each, and costs readers
        nothing (they are served from the held-block store meanwhile)."""
        batch = [first]
        batch_bytes = len(first[1])
        while batch_bytes < self._write_batch_bytes:
            try:
                batch.append(self._write_receive.receive_nowait())
            except trio.WouldBlock:
                break
            batch_bytes += len(batch[-1][1])
        if len(batch) > 1:
            return batch
        with trio.move_on_after(WRITE_GATHER_S):
            while batch_bytes < self._write_batch_bytes:
                try:
                    batch.append(await self._write_receive.receive())
                except trio.EndOfChannel:
                    break
                batch_bytes += len(batch[-1][1])
        return batch

    async def run_writer(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background task: commit fetched blocks to the cache in batches."""
        task_status.started()
        async with self._write_receive:
            async for first in self._write_receive:
                batch = await self._gather_batch(first)
                batch_bytes = sum(len(data) for _key, data, _force in batch)
                kept = [item for item in batch if item[0] not in self._discarded]
                ahead = self._claims.current(trio.current_time())  # read ahead, not read yet: offered or cached
                cached: set[BlockKey] = set()
                try:
                    if kept:
                        cached = await trio.to_thread.run_sync(self._insert, kept, ahead)
                finally:
                    for key, _data, _force in batch:
                        self._flights.pop(key, None)
                        self._settled(key, cached=key in cached)
                        self._discarded.discard(key)
                    self._write_room.give_back(batch_bytes)
                    self._batch_written.set()
                    self._batch_written = trio.Event()

    def _insert(self, blocks: list[_Written], ahead: frozenset[BlockKey]) -> set[BlockKey]:
        """Worker thread: cache the blocks; returns those read ahead (in `ahead`) that are
        now cached: only a read-ahead block waiting for its read needs to know."""
        self._cache.insert_many(blocks, ahead)
        waiting = [key for key, _data, _force in blocks if key in ahead]
        if not waiting:
            return set()
        return {key for key, cached in zip(waiting, self._cache.contains_each(waiting), strict=True) if cached}


def _not_in(indexes: set[int], count: int) -> list[int]:
    """The indexes below `count` not in `indexes`, in order (a batch's files not queued yet)."""
    return [index for index in range(count) if index not in indexes]
