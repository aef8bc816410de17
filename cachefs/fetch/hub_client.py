"""HTTP/1.1 to the hub on trio: h11 over trio TCP streams, persistent connections.

h11 (the sans-IO HTTP/1.1 state machine behind httpx) is used instead of a
full client: it is several times faster than httpx on trio
(docs/performance.md), and it leaves connection pooling and timeouts in our
hands.
"""

from __future__ import annotations

import fcntl
import json
import logging
import re
import select
import socket
import ssl
import sys
import termios
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from typing import Any, NotRequired, TypedDict

import h11
import trio

from ..buffers import BlockBuffers, Buffer, unfilled_buffer
from ..config import HubURL
from ..errors import BatchUnsupported, HubProtocolError, HubStatusError, HubTLSError, HubUnavailable, RemoteFileChanged
from .hub import PieceSink

log = logging.getLogger(__name__)

RECEIVE_BYTES = 1 << 20  # receive up to 1 MiB per syscall: fewer wakeups per block
# A body's receive on plain TCP sleeps until the rest of the piece it fills (a
# block, a small file) has arrived, up to this much (SO_RCVLOWAT): one wakeup
# per piece rather than one per burst the network delivers.
WAKE_BYTES = 1 << 20
# A response head is read in small receives, so that little of the body
# lands in h11's buffer (bodies of ranges bypass it).
RECEIVE_HEAD_BYTES = 16 * 1024
ERROR_BODY_BYTES = 4096  # of an unexpected answer, quoted in its error
# A manifest entry is a path (PATH_MAX is 4 KiB, JSON may escape a byte in 6)
# and, for a symlink, its target: a longer line is not a manifest.
MAX_MANIFEST_LINE_BYTES = 1 << 20
INFLATE_PIECE_BYTES = 256 << 10
_CONTENT_RANGE_RE = re.compile(rb"^bytes (\d+)-(\d+)/(\d+)$")
SUMS_HEADER = b"cachefs-block-sums"  # see hubserver/checksums.py
BATCH_SUMS_HEADER = b"cachefs-batch-sums"  # see hubserver/batch.py
# Answers of a hub that has no batch endpoint (an older one), or refuses this batch.
BATCH_UNKNOWN_STATUSES = (400, 404, 405)
# What one batch may name: the hub's limits (hubserver/batch.py, docs/protocol.md).
BATCH_MAX_FILES = 64
BATCH_MAX_BYTES = 8 * 1024 * 1024
_HEX16_RE = re.compile(rb"[0-9a-f]{16}")
_SUMS_RE = re.compile(rb"bs=(\d{1,10}); first=(\d{1,12}); ([0-9a-f]{16}(?:,[0-9a-f]{16}){0,63})")


class _Connection:
    """One keep-alive TCP connection with its h11 state machine."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        # The TCP socket a body is received from without a copy; None for TLS (decrypted here).
        self._tcp = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
        self._body_bypassed = False
        self._wake_bytes = 1  # the socket's SO_RCVLOWAT (plain TCP only)
        self._trickling = False  # less than a piece's rest came in a read timeout: wake for any byte

    async def send(self, event: h11.Request | h11.EndOfMessage) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.send_all(data)

    async def next_event(self, read_timeout_s: float, receive_bytes: int = RECEIVE_BYTES) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.move_on_after(read_timeout_s) as scope:
                chunk = await self.stream.receive_some(receive_bytes)
            if scope.cancelled_caught:
                raise HubSilent(f"hub sent nothing for {read_timeout_s:g} s")
            self.h11.receive_data(bytes(chunk))  # h11 takes bytes; bytes() of the bytes trio returns is no copy

    async def read_body_into(
        self,
        lengths: Sequence[int],
        read_timeout_s: float,
        on_filled: Callable[[int, Buffer], Awaitable[None]] | None = None,
        keep: bool = True,
        take: Callable[[int], Buffer] = unfilled_buffer,
    ) -> tuple[list[Buffer], int]:
        """Read a Content-Length body straight into one buffer per piece of `lengths`, in order;
        returns the buffers (none unless `keep`) and the bytes read.

        h11 parses the head; the body bypasses it: what h11 already buffered
        is copied out, the rest goes from the socket into the buffers with
        recv_into. This saves three copies per block, the client's main cost.
        Afterwards the connection gets a fresh h11 state for the next request.
        `await on_filled(i, buffer)` runs as soon as buffer i is full, before
        the next is received (it may raise, which aborts the read); each buffer
        is taken (`take(length)`) only when its turn comes, so a body handed on piece by
        piece (`keep=False`) holds one piece in memory, not all of them.
        """
        try:
            return await self._read_pieces_into(lengths, read_timeout_s, on_filled, keep, take)
        finally:
            self._wake_after(1)  # the next answer's head may be shorter than any piece

    async def _read_pieces_into(
        self,
        lengths: Sequence[int],
        read_timeout_s: float,
        on_filled: Callable[[int, Buffer], Awaitable[None]] | None,
        keep: bool,
        take: Callable[[int], Buffer],
    ) -> tuple[list[Buffer], int]:
        self._body_bypassed = True
        buffered = self._drain_h11_body()
        total = 0
        kept: list[Buffer] = []
        for index, length in enumerate(lengths):
            buffer = take(length)  # handed on only once filled
            view = memoryview(buffer)
            filled = 0
            while buffered and filled < length:
                piece = buffered.pop(0)
                taken = min(len(piece), length - filled)
                view[filled : filled + taken] = piece[:taken]
                if taken < len(piece):
                    buffered.insert(0, piece[taken:])
                filled += taken
            while filled < length:
                with trio.move_on_after(read_timeout_s) as scope:
                    received = await self._receive_into(view[filled:])
                if scope.cancelled_caught:
                    if self._wake_bytes > 1 and self._unread_bytes():
                        self._trickling = True  # bytes came, fewer than the piece's rest: not silence
                        continue
                    raise HubUnavailable(f"hub sent nothing for {read_timeout_s:g} s")
                if received == 0:
                    return kept, total + filled
                filled += received
            total += filled
            del view
            if keep:
                kept.append(buffer)
            if on_filled is not None:
                await on_filled(index, buffer)
        if buffered:
            raise HubProtocolError("hub sent more body than its Content-Length")
        return kept, total

    async def _receive_into(self, view: memoryview) -> int:
        """recv_into on plain TCP (no copy), woken once the rest of the piece is there (up to
        WAKE_BYTES); TLS streams decrypt into a chunk that is copied."""
        if self._tcp is not None:
            self._wake_after(1 if self._trickling else min(len(view), WAKE_BYTES))
            return await self._tcp.recv_into(view)
        chunk = await self.stream.receive_some(len(view))
        view[: len(chunk)] = chunk
        return len(chunk)

    def _wake_after(self, nbytes: int) -> None:
        """Have epoll report the socket readable only once `nbytes` are buffered (or the hub closed
        it, or the receive buffer is full); a receive that need not wait still returns what there is."""
        if nbytes == self._wake_bytes or self._tcp is None:
            return
        try:
            self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
        except OSError:
            return  # closed meanwhile: the receive reports it
        self._wake_bytes = nbytes

    def _unread_bytes(self) -> int:
        """Bytes the kernel holds for this socket that were not received yet (plain TCP)."""
        if self._tcp is None:
            return 0
        try:
            return int.from_bytes(fcntl.ioctl(self._tcp.fileno(), termios.FIONREAD, bytes(4)), sys.byteorder)
        except OSError:
            return 0

    def _drain_h11_body(self) -> list[bytes]:
        """Body bytes h11 received together with the head."""
        pieces: list[bytes] = []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.EndOfMessage):
                return pieces
            if not isinstance(event, h11.Data):
                raise HubProtocolError(f"unexpected {type(event).__name__} in response body")
            pieces.append(bytes(event.data))

    def reusable(self) -> bool:
        if self._body_bypassed:
            return True
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def quiet(self) -> bool:
        """Whether an idle keep-alive connection has nothing to read, as it should: not closed
        by the server, nor holding bytes nobody asked for (a 408 sent before closing it, the
        rest of an answer longer than it said). Plain TCP only; over TLS a reused
        connection's failure or 408 sends its request again (HubClient._start)."""
        if self._tcp is None:
            return True
        poller = select.poll()
        poller.register(self._tcp.fileno(), select.POLLIN | select.POLLRDHUP)
        return not poller.poll(0)

    def start_next_cycle(self) -> None:
        if self._body_bypassed:
            self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=64 * 1024)
            self._body_bypassed = False
        else:
            self.h11.start_next_cycle()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


class _Response:
    """Status and headers of a response whose body is still to be read."""

    def __init__(self, status: int, headers: dict[bytes, bytes]) -> None:
        self.status = status
        self.headers = headers


class ClientOptions(TypedDict):
    """HubClient's connection settings and block buffer pool (a TierClient gives its hub and each node the same)."""

    max_connections: int
    connect_timeout_s: float
    read_timeout_s: float
    token: NotRequired[str | None]
    ssl_context: NotRequired[ssl.SSLContext | None]
    buffers: NotRequired[BlockBuffers | None]


class HubClient:
    """Requests to one hub over a bounded pool of keep-alive connections."""

    def __init__(
        self,
        url: HubURL,
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        buffers: BlockBuffers | None = None,
    ) -> None:
        self.url = url
        self._take = buffers.take if buffers is not None else unfilled_buffer  # what a block's bytes are received into
        if url.tls and ssl_context is None:
            ssl_context = ssl.create_default_context()
        # TLS for https:// URLs only: a regional tier's http:// nodes beside an https:// hub
        # share its options, and a TLS handshake with them would fail every time.
        self._ssl_context = ssl_context if url.tls else None
        self._auth_header = [(b"Authorization", b"Bearer " + token.encode())] if token else []
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self.answers = 0  # responses received: unchanged since a moment, the hub answered nothing (fs/failed_reads.py)
        self._host_header = f"{url.host}:{url.port}".encode()

    async def aclose(self) -> None:
        while self._idle:
            await self._idle.pop().aclose()

    async def healthz(self) -> dict[str, Any]:
        """GET /healthz as a dict."""
        body = bytearray()
        async with self._request("/healthz") as (response, conn):
            await self._expect(response, conn, 200)
            async for chunk in self._body(conn):
                body += chunk
        return parse_json(bytes(body))

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
        """Bytes from `start` of one file version, as consecutive pieces of `lengths` bytes.

        One request; exactly those bytes or an error. Receiving into one
        buffer per piece (a block, for the cache) avoids copying them apart.
        With `sums_block_size`, the hub also sends the checksums of the blocks
        of that size the range covers whole: returned by block number (empty if
        the answer had none). With `on_piece`, each piece is awaited into it
        (with those checksums) as soon as it has arrived, before the next is
        received, and not returned.
        """
        length = sum(lengths)
        target = f"/v1/files/{file_id}?v={version}"
        if sums_block_size is not None:
            target += f"&bs={sums_block_size}"
        headers = [(b"Range", f"bytes={start}-{start + length - 1}".encode())]
        async with self._request(target, headers) as (response, conn):
            _refuse_changed(response, file_id)
            await self._expect(response, conn, 206)
            _check_content_range(response.headers.get(b"content-range", b""), start, length)
            _check_etag(response.headers.get(b"etag"), f"{file_id}-{version}", f"file {file_id} at {start}")
            if response.headers.get(b"content-length") != str(length).encode():
                raise HubProtocolError(f"hub answered {start}+{length} of file {file_id} without a matching Content-Length")
            sums_header = response.headers.get(SUMS_HEADER)
            sums = _parse_block_sums(sums_header, sums_block_size) if sums_header and sums_block_size else {}
            if on_piece is None:
                pieces = await self._read_pieces(conn, lengths, f"file {file_id} at {start}")
            else:
                async def arrived(index: int, piece: Buffer) -> None:
                    await on_piece(index, piece, sums)

                pieces = await self._read_pieces(conn, lengths, f"file {file_id} at {start}", arrived, keep=False)
        return pieces, sums

    async def get_batch(
        self,
        files: Sequence[tuple[str, str]],
        lengths: Sequence[int],
        block_size: int,
        on_file: Callable[[int, Buffer, int], Awaitable[None]],
    ) -> None:
        """Whole small files (id, version), each at most one block, in one request (hubserver/batch.py).

        `await on_file(i, bytes, checksum)` gets each file (`lengths`, from the
        manifest) with the hub's checksum of it as soon as it has arrived,
        before the rest of the answer is received (it may raise, which ends
        the request); none is kept here. RemoteFileChanged if any of them is not the hub's
        current version.
        """
        names = ",".join(f"{file_id}.{version}" for file_id, version in files)
        async with self._request(f"/v1/batch?bs={block_size}&f={names}") as (response, conn):
            if response.status == 412:
                raise RemoteFileChanged(f"a file of a batch of {len(files)} changed on the hub (412)")
            try:
                await self._expect(response, conn, 200)
            except HubStatusError as exc:
                if exc.status in BATCH_UNKNOWN_STATUSES:
                    raise BatchUnsupported(str(exc)) from None
                raise
            if response.headers.get(b"content-length") != str(sum(lengths)).encode():
                raise HubProtocolError(f"hub answered a batch of {len(files)} files with the wrong Content-Length")
            if BATCH_SUMS_HEADER not in response.headers:
                raise BatchUnsupported(f"a batch answer came without its {BATCH_SUMS_HEADER.decode()} header")
            sums = _parse_batch_sums(response.headers[BATCH_SUMS_HEADER], len(files))

            async def arrived(index: int, piece: Buffer) -> None:
                await on_file(index, piece, sums[index])

            await self._read_pieces(conn, lengths, f"a batch of {len(files)} files", arrived, keep=False)

    async def _read_pieces(
        self,
        conn: _Connection,
        lengths: Sequence[int],
        what: str,
        on_piece: Callable[[int, Buffer], Awaitable[None]] | None = None,
        keep: bool = True,
    ) -> list[Buffer]:
        """The body, received straight into one buffer per piece; exactly sum(lengths) bytes or an error.

        `await on_piece(i, piece)` gets each piece as soon as it is complete; without `keep`
        the pieces are not returned."""
        try:
            pieces, received = await conn.read_body_into(lengths, self._read_timeout_s, on_piece, keep, self._take)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:  # TLS streams raise trio's
            raise _translate(exc, self.url) from None
        if received != sum(lengths):
            raise HubProtocolError(f"hub sent {received} of {sum(lengths)} bytes for {what}")
        return pieces

    async def get_checksums(self, file_id: str, version: str, block_size: int, first: int, count: int) -> list[int]:
        """xxh3_64 of blocks [first, first+count) of one file version (fewer at the end of the file)."""
        target = f"/v1/files/{file_id}/checksums?v={version}&bs={block_size}&first={first}&count={count}"
        body = bytearray()
        async with self._request(target) as (response, conn):
            _refuse_changed(response, file_id)
            await self._expect(response, conn, 200)
            _check_etag(response.headers.get(b"etag"), f"{file_id}-{version}-{block_size}-{first}-{count}",
                        f"the checksums of file {file_id}")
            async for chunk in self._body(conn):
                body += chunk
                if len(body) > 8 * count:
                    raise HubProtocolError(f"hub sent too many checksums for file {file_id}")
        if len(body) % 8 or not body:
            raise HubProtocolError(f"hub sent a malformed checksum list for file {file_id}")
        return [int.from_bytes(body[i : i + 8], "big") for i in range(0, len(body), 8)]

    async def manifest_lines(self, on_received: Callable[[int], None] | None = None) -> AsyncGenerator[bytes, None]:
        """Stream the manifest's NDJSON lines (header first), gunzipped, unparsed.
        `on_received` gets the size of every piece of the body as it arrives (gzipped)."""
        async with self._request("/v1/manifest") as (response, conn):
            await self._expect(response, conn, 200)
            gzipped = response.headers.get(b"content-encoding", b"").lower() == b"gzip"
            inflater = zlib.decompressobj(wbits=31) if gzipped else None
            pending = b""
            async for chunk in self._body(conn):
                if on_received is not None:
                    on_received(len(chunk))
                for text in _inflated(inflater, chunk) if inflater else (chunk,):
                    pending += text
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line:
                            yield line
                    if len(pending) > MAX_MANIFEST_LINE_BYTES:
                        raise HubProtocolError(f"manifest line longer than {MAX_MANIFEST_LINE_BYTES} bytes")
            if inflater is not None and not inflater.eof:
                raise HubProtocolError("manifest stream ended early")
            if pending.strip():
                yield pending

    # -- plumbing -------------------------------------------------------------

    def _request(
        self, target: str, extra_headers: list[tuple[bytes, bytes]] | None = None
    ) -> _RequestContext:
        return _RequestContext(self, self.url.prefix + target, extra_headers or [])

    async def _acquire(self) -> tuple[_Connection, bool]:
        """A connection, and whether it is an idle one reused (else new)."""
        while self._idle:
            idle = self._idle.pop()
            if idle.quiet():
                return idle, True
            await idle.aclose()
        try:
            with trio.fail_after(self._connect_timeout_s):
                tcp = await trio.open_tcp_stream(self.url.host, self.url.port)
                stream: trio.abc.Stream = tcp if self._ssl_context is None else await self._tls(tcp)
        except trio.TooSlowError:
            raise HubUnavailable(f"cannot connect to hub {self.url}: timed out") from None
        except OSError as exc:
            raise HubUnavailable(f"cannot connect to hub {self.url}: {exc.strerror or exc}") from None
        return _Connection(stream), False

    async def _tls(self, tcp: trio.SocketStream) -> trio.SSLStream[trio.SocketStream]:
        assert self._ssl_context is not None
        stream = trio.SSLStream(tcp, self._ssl_context, server_hostname=self.url.host, https_compatible=True)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            await tcp.aclose()
            cause = exc.__cause__
            if isinstance(cause, ssl.SSLCertVerificationError):
                raise HubTLSError(f"hub {self.url} failed TLS verification: {cause.verify_message}") from None
            raise HubUnavailable(f"TLS handshake with hub {self.url} failed: {cause or exc}") from None
        return stream

    async def _start(
        self, target: str, extra_headers: list[tuple[bytes, bytes]]
    ) -> tuple[_Response, _Connection]:
        headers = [(b"Host", self._host_header), (b"Accept-Encoding", b"gzip"), *self._auth_header, *extra_headers]
        request = h11.Request(method="GET", target=target.encode(), headers=headers)
        while True:
            conn, reused = await self._acquire()
            try:
                await conn.send(request)
                await conn.send(h11.EndOfMessage())
                event = await conn.next_event(self._read_timeout_s, RECEIVE_HEAD_BYTES)
                while isinstance(event, h11.InformationalResponse):  # 100 Continue, 103 Early Hints: the answer follows
                    event = await conn.next_event(self._read_timeout_s, RECEIVE_HEAD_BYTES)
                if not isinstance(event, h11.Response):
                    raise HubProtocolError(f"unexpected reply from hub: {type(event).__name__}")
                self.answers += 1
                if reused and event.status_code == 408:  # the server's word that it closed this idle connection
                    raise HubUnavailable("hub closed an idle connection (408)")
            except Exception as exc:
                await conn.aclose()
                translated = _translate(exc, self.url)
                if reused and isinstance(translated, (HubUnavailable, HubProtocolError)) and not isinstance(exc, HubSilent):
                    continue  # the hub closed an idle keep-alive connection: use a new one
                raise translated from None  # a silent one is a hub (or tier node) that stopped answering
            except BaseException:
                await conn.aclose()
                raise
            return _Response(event.status_code, {k.lower(): v for k, v in event.headers}), conn

    async def _body(self, conn: _Connection) -> AsyncGenerator[bytes, None]:
        while True:
            try:
                event = await conn.next_event(self._read_timeout_s)
            except Exception as exc:
                raise _translate(exc, self.url) from None
            if isinstance(event, h11.Data):
                yield event.data
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise HubProtocolError(f"unexpected {type(event).__name__} in response body")

    async def _expect(self, response: _Response, conn: _Connection, status: int) -> None:
        """Raise HubStatusError unless the answer has `status`, with the start of its body
        (at most ERROR_BODY_BYTES read: a proxy that drops Range answers 200 with a whole
        file; the connection is then closed, not reused)."""
        if response.status == status:
            return
        body = bytearray()
        while len(body) < ERROR_BODY_BYTES:
            try:
                event = await conn.next_event(self._read_timeout_s)
            except Exception as exc:
                raise _translate(exc, self.url) from None
            if not isinstance(event, h11.Data):
                break
            body += event.data
        try:
            message = str(json.loads(body).get("error", ""))
        except (ValueError, AttributeError):
            message = bytes(body[:200]).decode("utf-8", "replace")
        raise HubStatusError(response.status, f"hub answered {response.status}: {_one_line(message)}".rstrip(": "),
                             from_hub=_from_hub(response))


def _one_line(text: str, limit: int = 200) -> str:
    """`text` fit for one log line: control characters and runs of white space as one space."""
    printable = "".join(char if char.isprintable() else " " for char in text)
    return " ".join(printable.split())[:limit]


def _inflated(inflater: Any, data: bytes) -> Iterator[bytes]:
    """Gunzip `data` in pieces of at most INFLATE_PIECE_BYTES (a gzip bomb inflates 1000:1)."""
    while True:
        try:
            text = inflater.decompress(data, INFLATE_PIECE_BYTES)
        except zlib.error as exc:
            raise HubProtocolError(f"corrupt manifest stream: {exc}") from None
        if text:
            yield text
        data = inflater.unconsumed_tail
        if not data and len(text) < INFLATE_PIECE_BYTES:
            return


class _RequestContext:
    """async with: send the request, yield (response, connection), recycle or close it."""

    def __init__(self, client: HubClient, target: str, headers: list[tuple[bytes, bytes]]) -> None:
        self._client = client
        self._target = target
        self._headers = headers
        self._conn: _Connection | None = None

    async def __aenter__(self) -> tuple[_Response, _Connection]:
        await self._client._slots.acquire()
        try:
            response, self._conn = await self._client._start(self._target, self._headers)
        except BaseException:
            self._client._slots.release()
            raise
        return response, self._conn

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        conn = self._conn
        try:
            if conn is not None:
                if exc_type is None and conn.reusable():
                    conn.start_next_cycle()
                    self._client._idle.append(conn)
                else:
                    await conn.aclose()
        finally:
            self._client._slots.release()


class HubSilent(HubUnavailable):
    """The hub sent nothing within the read timeout: not a keep-alive connection it closed, which
    fails at once, but a hub (or tier node) that stopped answering; its other idle connections
    would each cost a timeout too."""


# A TLS 1.3 hub that refuses the client's certificate (--tls-client-ca) does so after the
# handshake: the client sees its connection closed or reset without an answer.
_REFUSED_CERTIFICATE_HINT = ("; a hub with --tls-client-ca drops the connection of a client certificate "
                             "it refuses, or of none: check --tls-cert and --tls-key")


def _translate(exc: BaseException, url: HubURL) -> BaseException:
    """Map transport failures to HubUnavailable/HubProtocolError; keep ours and trio's."""
    if isinstance(exc, (HubUnavailable, HubProtocolError, HubStatusError, HubTLSError)):
        return exc
    if isinstance(exc, h11.RemoteProtocolError):
        if "ConnectionClosed" in str(exc):  # h11's words for a connection closed before the answer
            hint = _REFUSED_CERTIFICATE_HINT if url.tls else ""
            return HubProtocolError(f"hub {url} closed the connection without an answer{hint}")
        return HubProtocolError(f"hub {url} broke the HTTP protocol: {exc}")
    if isinstance(exc, (OSError, trio.BrokenResourceError, trio.ClosedResourceError)):
        reset = isinstance(exc.__cause__ or exc, ConnectionResetError) or "reset by peer" in str(exc)
        hint = _REFUSED_CERTIFICATE_HINT if url.tls and reset else ""
        return HubUnavailable(f"connection to hub {url} failed: {exc}{hint}")
    return exc


def _parse_block_sums(value: bytes, block_size: int) -> dict[int, int]:
    """`bs=<n>; first=<block>; <hex>,<hex>...` -> {block number: checksum} (for blocks of `block_size`)."""
    match = _SUMS_RE.fullmatch(value.strip())
    if match is None:
        raise HubProtocolError(f"hub sent a malformed {SUMS_HEADER.decode()} header")
    if int(match.group(1)) != block_size:
        return {}
    first = int(match.group(2))
    return {first + index: int(text, 16) for index, text in enumerate(match.group(3).split(b","))}


def _parse_batch_sums(value: bytes, count: int) -> list[int]:
    """`<hex>,<hex>,...` -> one checksum per file of the batch."""
    sums = value.strip().split(b",")
    if len(sums) != count or not all(_HEX16_RE.fullmatch(text) for text in sums):
        raise HubProtocolError(f"hub sent a malformed {BATCH_SUMS_HEADER.decode()} header")
    return [int(text, 16) for text in sums]


def _refuse_changed(response: _Response, file_id: str) -> None:
    """RemoteFileChanged for a file of the mounted snapshot that the hub no longer serves as
    it was: another version (412), or none at all after a rescan removed it (404: only the
    hub's own answer, JSON, says so; a proxy's or cache node's 404 page is not about the file)."""
    if response.status == 412:
        raise RemoteFileChanged(f"file {file_id} changed on the hub (412)")
    if response.status == 404 and _from_hub(response):
        raise RemoteFileChanged(f"file {file_id} is no longer on the hub (404)")


def _from_hub(response: _Response) -> bool:
    """Whether an error answer is the hub's own (its errors are JSON: docs/protocol.md)."""
    return response.headers.get(b"content-type", b"").split(b";")[0].strip() == b"application/json"


def _check_content_range(value: bytes, start: int, length: int) -> None:
    match = _CONTENT_RANGE_RE.match(value.strip())
    if not match or int(match.group(1)) != start or int(match.group(2)) != start + length - 1:
        raise HubProtocolError(f"hub answered range {value!r}, asked for {start}+{length}")


def _check_etag(value: bytes | None, expected: str, what: str) -> None:
    """Refuse an answer whose ETag names another file, version or span than the one asked
    for: the hub's ETag names them (hubserver/handlers.py, checksums.py), and a cache in
    between (a tier node whose cache key lost the version, say) passes on the ETag of what
    it cached, with that answer's own checksums header, which the bytes would then pass.
    An answer without ETag (a proxy that drops it) is taken: its bytes still meet their checksums."""
    if value is None:
        return
    tag = value.strip().removeprefix(b"W/")
    if tag != f'"{expected}"'.encode():
        raise HubProtocolError(f"hub answered {what} with the ETag {bytes(tag[:80])!r}, not of what was asked")


def parse_json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise HubProtocolError(f"hub sent invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HubProtocolError("hub sent JSON that is not an object")
    return value
