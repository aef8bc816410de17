"""Many small files in one answer: `GET /v1/batch?bs={block_size}&f={id}.{v},{id}.{v},...`.

A spoke reading a tree of small files would otherwise pay one request (and
one round trip of a WAN) per file. A batch names up to `MAX_FILES` whole
files, each at most one block of the spoke's block size; the answer is their
bytes back to back, in the order asked, with the xxh3-64 of each (its only
block) in the `Cachefs-Batch-Sums` header. The spoke knows every size from
the manifest, so no framing is needed.

All or nothing: if any file is not the snapshot's (unknown id, other
version, changed on disk since the scan), the answer is 412 and the spoke
asks for the files one by one, which tells it which one changed.

The files are read and hashed first (that is what the header needs), with
at most MAX_IN_MEMORY batches in memory at once; then sent from their
descriptors with sendfile, holding no memory: a client reading slowly holds
its connection, not a slot. A file that changes between the two (the
bytes sent would not match the sums) ends the connection; the spoke
retries, and its checksum check never lets such bytes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from typing import Final

import xxhash
from aiohttp import web

from hubserver.checksums import block_bytes_param
from hubserver.clients import request_client
from hubserver.errors import FileChangedError, FileUnavailableError, HubHTTPError, NotInSnapshotError
from hubserver.fairness import PerClientTurns
from hubserver.files import open_unchanged, read_block
from hubserver.handlers import IMMUTABLE_CACHE_CONTROL, check_query, json_error, send_file_range
from hubserver.metrics import ENDPOINT_BATCH
from hubserver.rescan import SNAPSHOT_KEY
from hubserver.snapshot import FileRecord, Snapshot

log = logging.getLogger(__name__)

MAX_FILES: Final = 64
MAX_BYTES: Final = 8 * 1024 * 1024  # what one answer holds in the hub's memory
# Batches being read and hashed at once (at most 256 MiB in memory); one more
# is answered 503 at once (clients retry). Sending holds no slot.
MAX_IN_MEMORY: Final = 32
# ... of one client (an address): half, as for connections, so that one client
# never takes them all.
MAX_IN_MEMORY_PER_CLIENT: Final = MAX_IN_MEMORY // 2
SUMS_HEADER: Final = "Cachefs-Batch-Sums"
_QUERY: Final = frozenset({"bs", "f"})
_NAME: Final = r"[0-9a-f]{16}\.[0-9a-f]{16}"
_NAMES_RE: Final = re.compile(f"{_NAME}(?:,{_NAME}){{0,{MAX_FILES - 1}}}")


class BatchSlots:
    """The batches being read and hashed: at most MAX_IN_MEMORY in all, and
    MAX_IN_MEMORY_PER_CLIENT of one client. `on_hashed` counts the bytes hashed."""

    def __init__(self, on_hashed: Callable[[str, int], object] = lambda _endpoint, _bytes: None) -> None:
        self._all = asyncio.Semaphore(MAX_IN_MEMORY)
        self._turns = PerClientTurns(MAX_IN_MEMORY_PER_CLIENT)
        self.on_hashed = on_hashed

    def full(self, client: str) -> bool:
        """Whether a batch of `client` would have to wait for a slot now."""
        return self._all.locked() or self._turns.busy(client)

    @contextlib.asynccontextmanager
    async def taken(self, client: str) -> AsyncIterator[None]:
        async with self._turns.turn(client), self._all:
            yield


SLOTS_KEY: Final = web.AppKey("batch_slots", BatchSlots)


async def batch(request: web.Request) -> web.StreamResponse:
    """The named files' bytes back to back, their checksums in SUMS_HEADER."""
    check_query(request, _QUERY)
    block_bytes = block_bytes_param(request)
    names = request.query.get("f", "")
    if not _NAMES_RE.fullmatch(names):
        raise HubHTTPError(400, f"f must list 1 to {MAX_FILES} files as <id>.<version>, comma-separated")
    snapshot = request.app[SNAPSHOT_KEY].current
    try:
        records = [_record(snapshot, name, block_bytes) for name in names.split(",")]
        if sum(record.size_bytes for record in records) > MAX_BYTES:
            raise HubHTTPError(400, f"a batch holds at most {MAX_BYTES} bytes")
        slots = request.app[SLOTS_KEY]
        client = request_client(request)
        if slots.full(client):
            raise HubHTTPError(503, "too many batches under way; retry", {"Retry-After": "1"})
        async with slots.taken(client):
            sums = await asyncio.get_running_loop().run_in_executor(None, _hash_all, snapshot, records, slots.on_hashed)
    except NotInSnapshotError as exc:
        log.info("batch: %s; answering 412", exc)
        return json_error(412, str(exc))
    except FileUnavailableError as exc:
        log.warning("batch: %s; answering 503", exc)
        return json_error(503, "a file of the batch cannot be read now; retry", {"Retry-After": "1"})
    return await _send(request, snapshot, records, sums)


async def _send(request: web.Request, snapshot: Snapshot, records: list[FileRecord], sums: list[int]) -> web.StreamResponse:
    """200 with the files back to back, sent from their descriptors, and their checksums in SUMS_HEADER."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "application/octet-stream",
            "Cache-Control": IMMUTABLE_CACHE_CONTROL,
            SUMS_HEADER: ",".join(format(checksum, "016x") for checksum in sums),
        }
    )
    response.content_length = sum(record.size_bytes for record in records)
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    for record in records:
        if record.size_bytes == 0:
            continue
        try:
            fd = await loop.run_in_executor(None, open_unchanged, snapshot, record)
        except (FileChangedError, FileUnavailableError) as exc:  # since it was hashed: the answer is cut
            log.warning("batch: file %s cannot be sent (%s); closing the connection", record.file_id, exc)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(f"file {record.file_id} cannot be sent") from None
        try:
            await send_file_range(request, fd, record, 0, record.size_bytes)
        finally:
            os.close(fd)
    await response.write_eof()
    return response


def _record(snapshot: Snapshot, name: str, block_bytes: int) -> FileRecord:
    file_id, version = name.split(".")
    record = snapshot.files_by_id.get(file_id)
    if record is None or record.version != version:
        raise NotInSnapshotError(f"file {file_id} version {version} is not in this snapshot")
    if record.size_bytes > block_bytes:
        raise HubHTTPError(400, f"file {file_id} is larger than one block of {block_bytes} bytes")
    return record


def _hash_all(snapshot: Snapshot, records: list[FileRecord], on_hashed: Callable[[str, int], object]) -> list[int]:
    """Each file's xxh3_64, read from the inode the scan recorded; `on_hashed` counts the
    bytes. Blocking."""
    sums = []
    for record in records:
        try:
            fd = open_unchanged(snapshot, record)
        except FileChangedError as exc:
            log.warning("file %s: %s", record.file_id, exc)
            raise NotInSnapshotError(f"file {record.file_id} changed on disk since the snapshot") from None
        try:
            content = read_block(fd, record, record.size_bytes, 0)
        finally:
            os.close(fd)
        on_hashed(ENDPOINT_BATCH, len(content))
        if len(content) != record.size_bytes:
            raise NotInSnapshotError(f"file {record.file_id} shrank on disk since the snapshot")
        sums.append(xxhash.xxh3_64_intdigest(content))
    return sums
