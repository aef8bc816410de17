"""File data through a regional tier of nginx caches: each slice from the node that owns it, else the next, last the hub.

Every slice of a file (an aligned `--tier-slice` range, nginx's `slice` on
the nodes) is owned by one tier node, chosen by rendezvous hashing of the
file id and slice number over the nodes' positions in the `--tier` list. So
every spoke of a region asks the same node for the same slice, each node
caches only its share, and the region's tier holds the dataset once, even
when it is larger than one node's disk. A node that fails (refused, reset,
timed out, its certificate refused, 502/504) is skipped for a while and its slices are asked of the
next node in their own order; when no node answers, of the hub itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar, Unpack

import trio
import xxhash

from ..buffers import Buffer
from ..config import HubURL
from ..errors import BatchUnsupported, HubError, HubProtocolError, HubStatusError, HubTLSError, HubUnavailable
from ..metrics import Stats
from .hub import PieceSink
from .hub_client import ClientOptions, HubClient

log = logging.getLogger(__name__)

T = TypeVar("T")

# A node that failed is skipped this long, then tried again: long enough that
# a dead node costs one connect timeout per spoke and not one per slice, short
# enough that a restarted node gets its slices back within seconds.
NODE_DOWN_S = 10.0
# Errors of nginx itself: the node could not reach the hub in time (502, 504), or
# cannot read its own cache file of the slice (500, on every later request for it
# until the entry is purged). Other statuses come from the hub (nginx passes them
# through) and would be the same from any node.
FAILOVER_STATUSES = (500, 502, 504)
HUB = "hub"  # the `node` label of requests that went to the hub itself


def slice_owners(file_id: str, slice_number: int, node_count: int) -> list[int]:
    """The nodes (positions in the list) in the order they are asked for one slice.

    Rendezvous hashing: each node scores the slice with its own seed, the
    highest score owns it. Appending a node moves only the slices it now
    wins (a 1/N share); the others keep their owner and their cached bytes.
    """
    key = f"{file_id}/{slice_number}".encode()
    return sorted(range(node_count), key=lambda node: xxhash.xxh3_64_intdigest(key, seed=node), reverse=True)


@dataclasses.dataclass(frozen=True, slots=True)
class SlicePart:
    """The part of a range that lies in one slice: its start and the lengths of its pieces,
    and for each of those the index of the caller's piece it is (a part of)."""

    start: int
    lengths: list[int]
    piece_of: list[int]


def split_at_slices(start: int, lengths: Sequence[int], slice_bytes: int) -> list[SlicePart]:
    """Consecutive pieces from `start` as parts of one slice each; a piece over a slice boundary is cut there."""
    parts: list[SlicePart] = []
    offset = start
    for index, length in enumerate(lengths):
        end = offset + length
        while True:
            cut = min(end, (offset // slice_bytes + 1) * slice_bytes)
            if parts and parts[-1].start // slice_bytes == offset // slice_bytes:
                parts[-1].lengths.append(cut - offset)
                parts[-1].piece_of.append(index)
            else:
                parts.append(SlicePart(offset, [cut - offset], [index]))
            offset = cut
            if offset >= end:
                break
    return parts


class TierClient(HubClient):
    """A HubClient whose file data and checksums come through the tier's nodes.

    The manifest and health checks still go to the hub (this client's own
    connections), and so does data that no node can serve.
    """

    def __init__(
        self,
        hub_url: HubURL,
        node_urls: Sequence[HubURL],
        *,
        slice_bytes: int,
        stats: Stats,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(hub_url, **options)
        self._nodes = [HubClient(url, **options) for url in node_urls]  # the token too: nginx passes it on with each miss
        self._slice_bytes = slice_bytes
        self._stats = stats
        self._down_until = [0.0] * len(self._nodes)  # trio time; 0: never failed, or answered since
        for node in range(len(self._nodes)):  # exported at 0, so that rate() sees the first one
            stats.tier_requests[str(node)] += 0
            stats.tier_failovers[str(node)] += 0
        stats.tier_requests[HUB] += 0

    @property
    def answers(self) -> int:
        """Responses from the hub and from every node: unchanged, nothing upstream answered (failed_reads.py)."""
        return self._hub_answers + sum(node.answers for node in self._nodes)

    @answers.setter
    def answers(self, count: int) -> None:
        self._hub_answers = count  # HubClient counts the hub's own answers here

    async def aclose(self) -> None:
        for node in self._nodes:
            await node.aclose()
        await super().aclose()

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
        """As HubClient.get_range; a range over several slices is asked of their owners side by
        side (and handed to `on_piece` once all of it has arrived)."""
        parts = split_at_slices(start, lengths, self._slice_bytes)
        if len(parts) == 1:
            return await self._slice_range(file_id, version, parts[0].start, lengths, sums_block_size, on_piece)
        results: list[tuple[list[Buffer], dict[int, int]]] = [([], {})] * len(parts)
        errors: list[HubError] = []

        async def get_part(index: int, part: SlicePart, cancel: trio.CancelScope) -> None:
            try:
                results[index] = await self._slice_range(file_id, version, part.start, part.lengths, sums_block_size, None)
            except HubError as exc:  # raised below; the other parts are not needed any more
                errors.append(exc)
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            for index, part in enumerate(parts):
                nursery.start_soon(get_part, index, part, nursery.cancel_scope)
        if errors:
            raise errors[0]
        cut: list[list[Buffer]] = [[] for _ in lengths]  # each caller's piece, in one or more parts
        sums: dict[int, int] = {}
        for part, (part_pieces, part_sums) in zip(parts, results, strict=True):
            for owner, piece in zip(part.piece_of, part_pieces, strict=True):
                cut[owner].append(piece)
            sums.update(part_sums)
        # A block larger than a slice came in slices: joined, one copy (only then).
        joined = [pieces[0] if len(pieces) == 1 else self._joined(pieces) for pieces in cut]
        if on_piece is None:
            return joined, sums
        for index, piece in enumerate(joined):
            await on_piece(index, piece, sums)
        return [], sums

    def _joined(self, pieces: list[Buffer]) -> Buffer:
        """One buffer of the pieces in order (taken as HubClient takes a block's)."""
        joined = self._take(sum(len(piece) for piece in pieces))
        offset = 0
        for piece in pieces:
            joined[offset : offset + len(piece)] = piece
            offset += len(piece)
        return joined

    async def _slice_range(
        self, file_id: str, version: str, start: int, lengths: Sequence[int], sums_block_size: int | None,
        on_piece: PieceSink | None,
    ) -> tuple[list[Buffer], dict[int, int]]:
        return await self._routed(
            file_id,
            start,
            lambda node: node.get_range(file_id, version, start, lengths, sums_block_size=sums_block_size,
                                        on_piece=on_piece),
            lambda: HubClient.get_range(self, file_id, version, start, lengths, sums_block_size=sums_block_size,
                                        on_piece=on_piece),
        )

    async def get_checksums(self, file_id: str, version: str, block_size: int, first: int, count: int) -> list[int]:
        """As HubClient.get_checksums, from the node owning the span's first block (nodes cache them too)."""
        return await self._routed(
            file_id,
            first * block_size,
            lambda node: node.get_checksums(file_id, version, block_size, first, count),
            lambda: HubClient.get_checksums(self, file_id, version, block_size, first, count),
        )

    async def get_batch(
        self,
        files: Sequence[tuple[str, str]],
        lengths: Sequence[int],
        block_size: int,
        on_file: Callable[[int, Buffer, int], Awaitable[None]],
    ) -> None:
        """Never: two spokes never form the same batch, so a batch would not be shared by
        the region; each small file is asked for on its own, and cached by its node."""
        raise BatchUnsupported("the regional tier shares small files one by one, not in batches")

    async def _routed(
        self,
        file_id: str,
        offset: int,
        from_node: Callable[[HubClient], Awaitable[T]],
        from_hub: Callable[[], Awaitable[T]],
    ) -> T:
        """The answer of the first node in the slice's order that gives one, else the hub's."""
        for node in slice_owners(file_id, offset // self._slice_bytes, len(self._nodes)):
            if self._down_until[node] > trio.current_time():
                continue
            try:
                answer = await from_node(self._nodes[node])
            except (HubUnavailable, HubProtocolError, HubTLSError) as exc:  # a node down, or not to be trusted
                self._node_failed(node, exc, file_id, offset, skip=True)
                continue
            except HubStatusError as exc:
                if exc.status in FAILOVER_STATUSES:  # the node is up; the hub is slow or away
                    self._node_failed(node, exc, file_id, offset, skip=False)
                    continue
                if not exc.from_hub:  # the node's own refusal (403, a 404 page): not to be asked for now
                    self._node_failed(node, exc, file_id, offset, skip=True)
                    continue
                raise
            if self._down_until[node]:
                log.info("tier node %s answers again", self._nodes[node].url)
                self._down_until[node] = 0.0
            self._stats.tier_requests[str(node)] += 1
            return answer
        answer = await from_hub()
        self._stats.tier_requests[HUB] += 1
        return answer

    def _node_failed(self, node: int, error: HubError, file_id: str, offset: int, *, skip: bool) -> None:
        self._stats.tier_failovers[str(node)] += 1
        if not skip:
            log.info("tier node %s failed file %s at %d (%s): asking the next one", self._nodes[node].url, file_id, offset, error)
            return
        if self._down_until[node] <= trio.current_time():  # one warning per outage, not one per request in flight
            log.warning(
                "tier node %s failed file %s at %d (%s): its slices go to the next nodes for %g s",
                self._nodes[node].url, file_id, offset, error, NODE_DOWN_S,
            )
        self._down_until[node] = trio.current_time() + NODE_DOWN_S
