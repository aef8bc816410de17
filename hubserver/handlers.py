"""The hub's endpoints (health, manifest, ranged file data, metrics, rescan), answering errors as JSON."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import weakref
from typing import Final

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter

from hubserver.access_log import printable
from hubserver.errors import FileChangedError, FileUnavailableError, HubHTTPError, RangeNotSatisfiable
from hubserver.files import open_unchanged
from hubserver.metrics import ENDPOINT_OTHER, ENDPOINTS, HubMetrics
from hubserver.rescan import SNAPSHOT_KEY
from hubserver.snapshot import FileRecord

log = logging.getLogger(__name__)

MANIFEST_CHUNK_BYTES_KEY: Final = web.AppKey("manifest_chunk_bytes", int)
METRICS_KEY: Final = web.AppKey("metrics", HubMetrics)
BODY_BYTES_KEY: Final = web.RequestKey("body_bytes", int)
"""Body bytes of a streamed response (no Content-Length), once all sent."""

SERVER_HEADER = "cachefs-hub"

NDJSON_CONTENT_TYPE = "application/x-ndjson"
# A versioned URL never changes content, so any cache may keep it forever.
IMMUTABLE_CACHE_CONTROL = "public, max-age=31536000, immutable"

_HEX16_RE: Final = re.compile(r"[0-9a-f]{16}")
# One byte range (the grammar aiohttp's FileResponse accepts, which caches in
# front of the hub are likely to share).
_RANGE_RE: Final = re.compile(r"bytes=(\d*)-(\d*)", re.ASCII | re.IGNORECASE)
# Byte positions fit in 63 bits; longer numbers are refused before int().
_MAX_POSITION_DIGITS: Final = 19
# Query parameters each endpoint accepts; anything else is a 400.
_FILES_QUERY: Final = frozenset({"v", "bs"})  # bs: see checksums.file_data
NO_QUERY: Final = frozenset[str]()


def unavailable(record: FileRecord, exc: FileUnavailableError) -> web.Response:
    """The answer when a file cannot be opened or read for a reason that may pass: 503,
    which clients retry (a 412 would tell them the file changed)."""
    log.warning("file %s: %s; answering 503", record.file_id, exc)
    return json_error(503, f"file {record.file_id} cannot be read now; retry", {hdrs.RETRY_AFTER: "1"})


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The protocol's error answer: `{"error": "<one line>"}`."""
    one_line = " ".join(message.split())
    return web.json_response({"error": one_line}, status=status, headers=headers)


def endpoint_of(request: web.Request) -> str:
    """The route name of a request (a metrics label), "other" if none."""
    name = request.match_info.route.name
    return name if name in ENDPOINTS else ENDPOINT_OTHER


def check_query(request: web.Request, allowed: frozenset[str]) -> None:
    """Refuse (400) a query parameter the endpoint does not take, or one
    given twice."""
    query = request.query
    for key in query:
        if key not in allowed:
            # The parameter is not named back: it may be a secret put in the URL.
            takes = ", ".join(sorted(allowed)) if allowed else "none"
            raise HubHTTPError(400, f"unexpected query parameter (this endpoint takes: {takes})")
        if len(query.getall(key)) > 1:
            raise HubHTTPError(400, f"query parameter {key!r} given more than once")


async def set_server_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` hook: name the server, not its versions."""
    response.headers[hdrs.SERVER] = SERVER_HEADER


async def healthz(request: web.Request) -> web.Response:
    """`GET /healthz`: liveness plus what the snapshot holds."""
    check_query(request, NO_QUERY)
    snapshot = request.app[SNAPSHOT_KEY].current
    return web.json_response(
        {
            "status": "ok",
            "generation": snapshot.generation,
            "files": snapshot.file_count,
            "bytes": snapshot.total_bytes,
        }
    )


async def manifest(request: web.Request) -> web.StreamResponse:
    """`GET /v1/manifest`: the snapshot as gzip NDJSON, streamed.

    The snapshot holds its manifest gzipped (compressed once, at the scan);
    it is sent in pieces of the configured size. aiohttp's own compression
    is never enabled on this response. A client that goes away mid-way ends
    the handler with ConnectionError.
    """
    check_query(request, NO_QUERY)
    # The manifest's bytes only: a slow reader must not keep a replaced snapshot's file table alive.
    snapshot = request.app[SNAPSHOT_KEY].current
    manifest_gz, entry_count = snapshot.manifest_gz, snapshot.entry_count
    del snapshot
    chunk_bytes = request.app[MANIFEST_CHUNK_BYTES_KEY]
    response = web.StreamResponse(
        headers={
            hdrs.CONTENT_TYPE: NDJSON_CONTENT_TYPE,
            hdrs.CONTENT_ENCODING: "gzip",
            hdrs.CACHE_CONTROL: "no-cache",
        }
    )
    response.enable_chunked_encoding()
    await response.prepare(request)
    body = memoryview(manifest_gz)
    sent_bytes = 0
    try:
        while sent_bytes < len(body):
            chunk = body[sent_bytes : sent_bytes + chunk_bytes]
            await response.write(chunk)
            sent_bytes += len(chunk)
        await response.write_eof()
    except ConnectionError as exc:
        log.info("manifest: client %s went away after %d bytes: %s", request.remote, sent_bytes, exc)
        raise
    request[BODY_BYTES_KEY] = sent_bytes
    log.debug("manifest: sent %d gzip bytes, %d entries", sent_bytes, entry_count)
    return response


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: this hub's metrics, Prometheus text format."""
    check_query(request, NO_QUERY)
    body, content_type = request.app[METRICS_KEY].exposition(request.headers.get(hdrs.ACCEPT))
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type, hdrs.CACHE_CONTROL: "no-store"})


async def rescan(request: web.Request) -> web.Response:
    """`POST /v1/rescan`: publish a new generation now (unless one was scanned just now).
    A root that cannot be scanned answers 503; the current generation stays."""
    check_query(request, NO_QUERY)
    holder = request.app[SNAPSHOT_KEY]
    try:
        snapshot, scanned = await holder.rescan(unless_recent=True)
    except OSError as exc:
        log.error("rescan failed: %s; still serving generation %s", exc.strerror or exc, holder.current.generation)
        raise HubHTTPError(503, f"cannot scan the root: {exc.strerror or exc}; still serving generation "
                                f"{holder.current.generation}") from None
    return web.json_response({"generation": snapshot.generation, "files": snapshot.file_count, "rescanned": scanned})


def parse_range(header: str | None, size_bytes: int) -> tuple[int, int] | None:
    """Check a Range header against a file size.

    Returns the first and last byte (inclusive), or None without a Range
    header. Raises RangeNotSatisfiable unless the header is exactly one
    satisfiable byte range: `bytes=a-b`, `bytes=a-` or `bytes=-n`.
    """
    if header is None:
        return None
    match = _RANGE_RE.fullmatch(header)
    if match is None:
        raise RangeNotSatisfiable(f"not a single byte range: {printable(header, 80)!r}")
    first_text, last_text = match.groups()
    if len(first_text) > _MAX_POSITION_DIGITS or len(last_text) > _MAX_POSITION_DIGITS:
        raise RangeNotSatisfiable("byte position out of range")
    if not first_text:
        if not last_text:
            raise RangeNotSatisfiable("empty byte range")
        suffix_bytes = int(last_text)
        if suffix_bytes == 0 or size_bytes == 0:
            raise RangeNotSatisfiable("empty suffix range")
        return max(size_bytes - suffix_bytes, 0), size_bytes - 1
    first = int(first_text)
    last = int(last_text) if last_text else size_bytes - 1
    if last < first:
        raise RangeNotSatisfiable(f"reversed byte range: {header}")
    if first >= size_bytes:
        raise RangeNotSatisfiable(f"range starts at {first}, file has {size_bytes} bytes")
    return first, min(last, size_bytes - 1)


class SnapshotFileResponse(web.StreamResponse):
    """One file of the snapshot (or a range of it), sent with sendfile from a verified
    open descriptor.

    The descriptor came from `open_unchanged`: the bytes sent are those of
    the scanned inode, nothing a path swap could substitute. Length and range
    are the snapshot's, not what a later stat says: a file that grows is sent
    no byte past the snapshot's size, and one that shrinks while it is sent
    ends the connection at once (the client sees a short body and retries),
    not a wait for bytes that never come. Conditional request headers are
    not acted on: the version in the URL is the validator.
    """

    def __init__(self, fd: int, record: FileRecord, byte_range: tuple[int, int] | None, versioned: bool) -> None:
        first, last = byte_range if byte_range is not None else (0, record.size_bytes - 1)
        super().__init__(
            status=206 if byte_range is not None else 200,
            headers={
                hdrs.CONTENT_TYPE: "application/octet-stream",
                # Only a URL naming the version never changes content; without `v` it is the
                # current one's, which a cache in between must not keep.
                hdrs.CACHE_CONTROL: IMMUTABLE_CACHE_CONTROL if versioned else "no-store",
                hdrs.ACCEPT_RANGES: "bytes",
                hdrs.ETAG: f'"{record.file_id}-{record.version}"',
            },
        )
        if byte_range is not None:
            self.headers[hdrs.CONTENT_RANGE] = f"bytes {first}-{last}/{record.size_bytes}"
        self.content_length = last - first + 1
        self.record = record
        self.byte_range = byte_range  # first and last byte asked for; None for the whole file
        self.fd = fd  # open until sent (close_fd)
        # Close the descriptor once sent, or when the response is dropped.
        self.close_fd = weakref.finalize(self, os.close, fd)

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """Send the headers and the bytes, then close the descriptor. Once sent, further
        calls do nothing (aiohttp prepares a response a middleware already sent)."""
        if self.prepared:
            return None
        try:
            writer = await super().prepare(request)
            if request.method != hdrs.METH_HEAD and self.content_length:
                await self._send_body(request)
            await super().write_eof()
            return writer
        finally:
            self.close_fd()

    async def _send_body(self, request: web.BaseRequest) -> None:
        offset = self.byte_range[0] if self.byte_range is not None else 0
        await send_file_range(request, self.fd, self.record, offset, self.content_length or 0)


async def send_file_range(request: web.BaseRequest, fd: int, record: FileRecord, offset: int, length: int) -> None:
    """Send `length` bytes of the open descriptor from `offset` as (part of) a prepared
    response's body: with sendfile on a plain connection, in pieces through the response's
    writer over TLS. A file that shrank ends the connection at once."""
    transport = request.transport
    if transport is None or transport.is_closing():  # the client went away (asyncio would raise RuntimeError)
        raise ConnectionResetError("connection lost")
    if request.secure:
        sent = await _send_in_pieces(request, fd, offset, length)
    else:
        with open(fd, "rb", buffering=0, closefd=False) as file:  # noqa: ASYNC230 (wraps the open descriptor)
            sent = await asyncio.get_running_loop().sendfile(transport, file, offset, length)
    if sent < length:
        log.warning("file %s shrank while being sent (%d of %d bytes); closing the connection",
                    record.file_id, sent, length)
        transport.abort()
        raise ConnectionResetError(f"file {record.file_id} shrank while being sent")


# Over TLS the bytes are read and written in pieces of this size.
_TLS_PIECE_BYTES: Final = 256 * 1024


async def _send_in_pieces(request: web.BaseRequest, fd: int, offset: int, length: int) -> int:
    """What asyncio's sendfile does over TLS (which has no sendfile), but through aiohttp's
    writer, which raises ConnectionResetError as soon as the client is gone: asyncio's own
    fallback reads on to the end of the range, logging a warning per piece written to the
    closed connection, or fails with an AttributeError. Returns the bytes sent (fewer if the
    file shrank)."""
    loop = asyncio.get_running_loop()
    sent = 0
    while sent < length:
        piece = await loop.run_in_executor(None, os.pread, fd, min(_TLS_PIECE_BYTES, length - sent), offset + sent)
        if not piece:
            break
        await request.writer.write(piece)
        sent += len(piece)
    return sent


def _lookup(request: web.Request) -> FileRecord:
    """The record a files request names; raises the protocol's 400/404/412."""
    check_query(request, _FILES_QUERY)
    file_id = request.match_info["file_id"]
    if not _HEX16_RE.fullmatch(file_id):
        raise HubHTTPError(400, "malformed file id: expected 16 lowercase hex digits")
    wanted_version = request.query.get("v")
    if wanted_version is not None and not _HEX16_RE.fullmatch(wanted_version):
        raise HubHTTPError(400, "malformed version: expected 16 lowercase hex digits")
    record = request.app[SNAPSHOT_KEY].current.files_by_id.get(file_id)
    if record is None:
        raise HubHTTPError(404, f"no file with id {file_id} in this snapshot")
    if wanted_version is not None and wanted_version != record.version:
        raise HubHTTPError(412, f"file {file_id}: version {wanted_version} is not the snapshot's {record.version}")
    return record


def _range_header(request: web.Request, record: FileRecord) -> str | None:
    """The one Range header of a files request; raises 416 for several."""
    values = request.headers.getall(hdrs.RANGE, [])
    if len(values) > 1:
        raise HubHTTPError(
            416,
            f"file {record.file_id}: more than one Range header",
            {hdrs.CONTENT_RANGE: f"bytes */{record.size_bytes}"},
        )
    return values[0] if values else None


async def file_data(request: web.Request) -> web.StreamResponse:
    """`GET /v1/files/{id}?v={version}`: bytes of one snapshot file."""
    record = _lookup(request)
    range_header = _range_header(request, record)
    snapshot = request.app[SNAPSHOT_KEY].current
    loop = asyncio.get_running_loop()
    try:
        fd = await loop.run_in_executor(None, open_unchanged, snapshot, record)
    except FileChangedError as exc:
        log.warning("file %s: %s; answering 412", record.file_id, exc)
        return json_error(412, f"file {record.file_id} changed on disk since the snapshot")
    except FileUnavailableError as exc:
        return unavailable(record, exc)
    try:
        byte_range = parse_range(range_header, record.size_bytes)
        return SnapshotFileResponse(fd, record, byte_range, versioned="v" in request.query)
    except RangeNotSatisfiable as exc:
        os.close(fd)
        return json_error(
            416,
            f"file {record.file_id}: {exc}",
            {hdrs.CONTENT_RANGE: f"bytes */{record.size_bytes}"},
        )
    except BaseException:
        os.close(fd)
        raise
