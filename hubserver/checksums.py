"""Block checksums, computed once each: `GET /v1/files/{id}/checksums?v=&bs=&first=&count=`,
or the `Cachefs-Block-Sums` header of `GET /v1/files/{id}?v=&bs=`.

The spoke checks every block it receives against the hub's xxh3-64 of it,
end to end. Checksums are computed when first asked for (reading the
blocks from the file the snapshot recorded) and remembered in a bounded
LRU, so a block read by many spokes is hashed once. Measured cost: one
read of the block from the page cache plus ~0.05 ms per MiB of hashing.

A data request that names the spoke's block size (`bs`) gets the sums of
the blocks its range covers whole in a header, so a small file costs one
request instead of a data and a checksum request. The header says which
blocks it covers (`bs=<n>; first=<block>; <hex>,<hex>...`): a cache in
between that answers from a larger aligned slice stays correct.

What one request can make the hub hash is bounded: a data request no more
than the bytes it returns (only whole blocks of its range are summed), a
checksums request MAX_HASHED_BYTES. The hashing threads are shared fairly:
one client has at most HASH_THREADS_PER_CLIENT of them at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Final

import xxhash
from aiohttp import hdrs, web

from hubserver import handlers
from hubserver.clients import request_client
from hubserver.errors import FileChangedError, FileUnavailableError, HubHTTPError, RequestAbandoned
from hubserver.fairness import PerClientTurns
from hubserver.files import check_descriptor_unchanged, check_unchanged, open_unchanged, read_block
from hubserver.handlers import json_error, unavailable
from hubserver.metrics import ENDPOINT_CHECKSUMS, ENDPOINT_FILES
from hubserver.rescan import SNAPSHOT_KEY
from hubserver.snapshot import FileRecord, Snapshot

log = logging.getLogger(__name__)

_HEX16: Final = re.compile(r"[0-9a-f]{16}")
_ALLOWED: Final = frozenset({"v", "bs", "first", "count"})
MIN_BLOCK_BYTES: Final = 64 * 1024
MAX_BLOCK_BYTES: Final = 64 * 1024 * 1024
MAX_COUNT: Final = 4096  # 32 KiB of answer
# Bytes one checksums request may have hashed (count x bs): the 64 blocks a spoke asks
# for at once with blocks of up to 4 MiB (fewer of larger ones), a fraction of a second
# of one thread from the page cache; an answer of a few bytes must not buy seconds of
# reading and hashing.
MAX_HASHED_BYTES: Final = 256 << 20
# Threads hashing blocks: their own, so that requests for many checksums
# never hold up the threads that open files and read batches for everyone.
HASH_THREADS: Final = 4
# ... of which one client (an address) uses at most this many at once, so that others
# always find one.
HASH_THREADS_PER_CLIENT: Final = HASH_THREADS // 2
# Checksums kept: ~250 bytes each in memory (key, value, LRU links), so at most
# ~65 MB; with 1 MiB blocks, the blocks of 256 GiB of data.
REMEMBERED: Final = 1 << 18
SUMS_HEADER: Final = "Cachefs-Block-Sums"
MAX_HEADER_SUMS: Final = 64  # ~1.1 KB of header; larger ranges get no header


_Key = tuple[str, str, int, int]  # file id, version, block size, block
# How often a request waiting for another's computation looks whether its client is still there.
_WAIT_CHECK_S: Final = 0.25


def _always_wanted() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class SumsAsked:
    """The checksums one request asks for: `count` blocks of `block_bytes` from block `first`."""

    snapshot: Snapshot
    record: FileRecord
    block_bytes: int
    first: int
    count: int
    fd: int | None = None  # a descriptor of the file from open_unchanged (already checked), else one is opened
    wanted: Callable[[], bool] = _always_wanted  # asked between blocks: False once the client went away
    client: str = "-"  # who asks (fairness.request_client): its turns in the hashing threads
    endpoint: str = ENDPOINT_CHECKSUMS  # what asks (a metrics label of the bytes hashed)


def still_connected(request: web.Request) -> Callable[[], bool]:
    """Whether the request's client is still connected (asked from the hashing threads)."""
    transport = request.transport
    return lambda: transport is not None and not transport.is_closing()


class ChecksumCache:
    """(file id, version, block size, block) -> xxh3_64, least recently used forgotten.

    Computed once: a request for sums another request is computing waits for
    that computation (many spokes starting cold on one dataset ask for the
    same blocks at once). `on_hashed` is told the bytes each computation read, and for
    which endpoint.
    """

    def __init__(
        self, capacity: int = REMEMBERED, on_hashed: Callable[[str, int], object] = lambda _endpoint, _bytes: None
    ) -> None:
        self._capacity = capacity
        self._on_hashed = on_hashed
        self._turns = PerClientTurns(HASH_THREADS_PER_CLIENT)
        self._sums: collections.OrderedDict[_Key, int] = collections.OrderedDict()
        self._computing: dict[_Key, threading.Event] = {}  # set when that computation is over
        self._lock = threading.Lock()
        self._hashers = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="checksums")

    async def sums(self, asked: SumsAsked) -> bytes:
        """`block_sums` in the hashing threads, in one of the asking client's turns."""
        async with self._turns.turn(asked.client):
            return await asyncio.get_running_loop().run_in_executor(self._hashers, self.block_sums, asked)

    def close(self) -> None:
        """Stop the hashing threads (at shutdown; hashing under way finishes in the background)."""
        self._hashers.shutdown(wait=False, cancel_futures=True)

    def block_sums(self, asked: SumsAsked) -> bytes:
        """8-byte big-endian checksums of the blocks, computing the missing ones. Blocking.

        Rounds until every sum is known: take those remembered, claim and compute
        those nobody is computing, then wait for the others' (its own share first:
        no waiting in a cycle). A computation that stops (its client went away,
        RequestAbandoned; a failure) leaves its blocks to the next round's claims.
        """
        record, block_bytes = asked.record, asked.block_bytes
        last = min(asked.first + asked.count, -(-record.size_bytes // block_bytes))
        keys = [(record.file_id, record.version, block_bytes, block) for block in range(asked.first, last)]
        known: dict[_Key, int] = {}
        hashed_here = False
        left = keys
        while left:
            with self._lock:
                remembered = {key: self._sums[key] for key in left if key in self._sums}
                others = {self._computing[key] for key in left if key not in remembered and key in self._computing}
                mine = [key for key in left if key not in remembered and key not in self._computing]
                done = threading.Event()
                self._computing.update((key, done) for key in mine)
                self._remember(remembered)  # their turn in the LRU is now too
            known.update(remembered)
            try:
                if mine:
                    hashed_here = True
                    self._compute(asked, mine, known)
            finally:
                with self._lock:
                    self._remember({key: known[key] for key in mine if key in known})
                    for key in mine:
                        del self._computing[key]
                done.set()
            for event in others:
                while not event.wait(_WAIT_CHECK_S):
                    if not asked.wanted():
                        raise RequestAbandoned(f"the client of the sums of {record.path!r} went away")
            left = [key for key in left if key not in known]
        if not hashed_here and asked.fd is None and not check_unchanged(asked.snapshot, record):
            raise FileChangedError(f"{record.path!r} changed since the scan")  # remembered sums are for the scanned file
        return b"".join(known[key].to_bytes(8, "big") for key in keys)

    def _remember(self, sums: dict[_Key, int]) -> None:
        """Keep these sums as the most recently used (the lock held)."""
        for key, checksum in sums.items():
            self._sums[key] = checksum
            self._sums.move_to_end(key)
        while len(self._sums) > self._capacity:
            self._sums.popitem(last=False)

    def _compute(self, asked: SumsAsked, keys: list[_Key], into: dict[_Key, int]) -> None:
        """Hash the blocks of `keys` into `into`, one by one, while the request is wanted."""
        record, block_bytes = asked.record, asked.block_bytes
        source = open_unchanged(asked.snapshot, record) if asked.fd is None else asked.fd
        try:
            hashed: dict[_Key, int] = {}
            try:
                for key in keys:
                    if not asked.wanted():
                        raise RequestAbandoned(f"the client of the sums of {record.path!r} went away")
                    data = read_block(source, record, block_bytes, key[3] * block_bytes)
                    self._on_hashed(asked.endpoint, len(data))
                    hashed[key] = xxhash.xxh3_64_intdigest(data)
            finally:
                if hashed:
                    # The open checked the inode before these reads; a write since then (in place,
                    # same size) would have them hash its bytes, remembered and sent as the old
                    # version's. A write changes mtime and ctime before any byte: check after.
                    check_descriptor_unchanged(source, record)
                    into.update(hashed)
        finally:
            if asked.fd is None:
                os.close(source)


CHECKSUMS_KEY: Final = web.AppKey("checksums", ChecksumCache)


def _int_param(request: web.Request, name: str, low: int, high: int) -> int:
    text = request.query.get(name, "")
    if not text.isascii() or not text.isdigit() or len(text) > 12 or not low <= int(text) <= high:
        raise HubHTTPError(400, f"query parameter {name} must be an integer from {low} to {high}")
    return int(text)


def block_bytes_param(request: web.Request) -> int:
    block_bytes = _int_param(request, "bs", MIN_BLOCK_BYTES, MAX_BLOCK_BYTES)
    if block_bytes & (block_bytes - 1):
        raise HubHTTPError(400, "bs must be a power of two")
    return block_bytes


def whole_blocks(byte_range: tuple[int, int], size_bytes: int, block_bytes: int) -> range:
    """The blocks of `block_bytes` that the range (first and last byte) covers whole; the
    last block of the file is whole when the range reaches the end of the file."""
    first = -(-byte_range[0] // block_bytes)
    end = byte_range[1] + 1
    stop = -(-size_bytes // block_bytes) if end >= size_bytes else end // block_bytes
    return range(first, max(first, stop))


async def file_data(request: web.Request) -> web.StreamResponse:
    """`GET /v1/files/{id}?v=[&bs=]`: the file's bytes (handlers.file_data); with
    `bs`, the checksums of the blocks the range covers whole in SUMS_HEADER (so the
    hub hashes no more than it sends, and no more than for a checksums request)."""
    block_bytes = block_bytes_param(request) if "bs" in request.query else None
    response = await handlers.file_data(request)
    if block_bytes is None or not isinstance(response, handlers.SnapshotFileResponse):
        return response  # no sums asked for, or an error answer
    if request.method == hdrs.METH_HEAD:
        return response  # no body: the sums would be bytes hashed for nothing sent
    record = response.record
    blocks = whole_blocks(response.byte_range or (0, record.size_bytes - 1), record.size_bytes, block_bytes)
    if record.size_bytes == 0 or not 0 < len(blocks) <= MAX_HEADER_SUMS or len(blocks) * block_bytes > MAX_HASHED_BYTES:
        return response  # the spoke asks the checksums endpoint, whose requests hash no more
    snapshot = request.app[SNAPSHOT_KEY].current
    checksums = request.app[CHECKSUMS_KEY]
    first = blocks.start
    try:
        sums = await checksums.sums(
            SumsAsked(snapshot, record, block_bytes, first, len(blocks), response.fd, still_connected(request),
                      request_client(request), ENDPOINT_FILES)
        )
    except FileChangedError as exc:
        response.close_fd()
        log.warning("file %s: %s; answering 412", record.file_id, exc)
        return json_error(412, f"file {record.file_id} changed on disk since the snapshot")
    except FileUnavailableError as exc:
        response.close_fd()
        return unavailable(record, exc)
    except RequestAbandoned as exc:
        response.close_fd()
        return _abandoned(exc)
    listed = ",".join(sums[i : i + 8].hex() for i in range(0, len(sums), 8))
    response.headers[SUMS_HEADER] = f"bs={block_bytes}; first={first}; {listed}"
    return response


async def file_checksums(request: web.Request) -> web.Response:
    """The checksums of `count` blocks of `bs` bytes from block `first` (fewer at the end of the file)."""
    for key in request.query:
        if key not in _ALLOWED or len(request.query.getall(key)) > 1:
            raise HubHTTPError(400, "checksums take v, bs, first and count, once each")
    file_id, version = request.match_info["file_id"], request.query.get("v", "")
    if not _HEX16.fullmatch(file_id) or not _HEX16.fullmatch(version):
        raise HubHTTPError(400, "file id and version must be 16 lowercase hex digits")
    block_bytes = block_bytes_param(request)
    first = _int_param(request, "first", 0, 1 << 40)
    count = _int_param(request, "count", 1, MAX_COUNT)
    if count * block_bytes > MAX_HASHED_BYTES:
        raise HubHTTPError(400, f"count x bs must be at most {MAX_HASHED_BYTES} bytes")
    snapshot = request.app[SNAPSHOT_KEY].current
    record = snapshot.files_by_id.get(file_id)
    if record is None:
        raise HubHTTPError(404, f"no file with id {file_id} in this snapshot")
    if version != record.version:
        raise HubHTTPError(412, f"file {file_id}: version {version} is not the snapshot's {record.version}")
    if first * block_bytes >= max(1, record.size_bytes):
        raise HubHTTPError(416, f"file {file_id} has no block {first} of {block_bytes} bytes")
    try:
        body = await request.app[CHECKSUMS_KEY].sums(
            SumsAsked(snapshot, record, block_bytes, first, count, wanted=still_connected(request),
                      client=request_client(request))
        )
    except FileChangedError as exc:
        log.warning("file %s: %s; answering 412", file_id, exc)
        return json_error(412, f"file {file_id} changed on disk since the snapshot")
    except FileUnavailableError as exc:
        return unavailable(record, exc)
    except RequestAbandoned as exc:
        return _abandoned(exc)
    return web.Response(
        body=body,
        content_type="application/octet-stream",
        headers={
            "Cache-Control": "public, max-age=31536000, immutable",
            "ETag": f'"{file_id}-{version}-{block_bytes}-{first}-{count}"',
        },
    )


def _abandoned(exc: RequestAbandoned) -> web.Response:
    """The answer to a request whose client went away while its sums were hashed (never
    delivered; 499, "client closed request", in the access log and metrics)."""
    log.debug("%s: stopped hashing", exc)
    return json_error(499, str(exc))
