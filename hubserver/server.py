"""Each client connection around aiohttp's requests: admitted under limits, TLS, timeouts, JSON for what the parser refuses.

aiohttp parses requests and bounds idle keep-alive connections itself; what
it lacks is added here, in a subclass of its connection handler
(`HubRequestHandler`) that the CLI's listening socket creates for every
connection:

- a cap on open connections, in all and per client address, counted when the
  TCP connection opens: beyond it a connection gets a canned 503 and is closed
  (with TLS it is closed at once, before any handshake);
- the TLS handshake, started by the connection once it is counted, and
  bounded by `header_timeout_s`;
- a request head timeout: a connection must deliver a complete request head
  within `header_timeout_s` of opening and of the first byte of each later
  request, or it is closed (slowloris). aiohttp's own keep-alive timer only
  bounds the idle time between requests;
- a send timeout: a client that accepts no data of a response for
  `send_timeout_s` is cut off by the kernel (TCP_USER_TIMEOUT), which
  covers sendfile too (slow read);
- JSON answers, without tracebacks, to requests the HTTP parser refuses.

The observe middleware (middlewares.py) tells the connection when a request
is in progress. The subclass is why pyproject.toml keeps aiohttp below its
next minor version.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import re
import socket
import ssl
import time
from typing import Any, Final

from aiohttp import hdrs, web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler

from hubserver.access_log import log_access
from hubserver.clients import client_of
from hubserver.config import HubConfig
from hubserver.handlers import SERVER_HEADER, json_error
from hubserver.metrics import ENDPOINT_MALFORMED, HubMetrics

log = logging.getLogger(__name__)

# A refused connection gets its 503 when its first bytes arrive (so the
# request is read and the close is clean), or after this long without any.
_REFUSAL_GRACE_S: Final = 1.0
# At most one "refusing connections" warning per this many seconds.
_REFUSAL_LOG_INTERVAL_S: Final = 10.0
_REFUSAL_BODY: Final = b'{"error": "too many connections: retry later"}'
_REFUSAL_RESPONSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json; charset=utf-8\r\n"
    b"Content-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n"
    b"Retry-After: 1\r\n"
    b"Server: " + SERVER_HEADER.encode() + b"\r\n"
    b"Connection: close\r\n\r\n" + _REFUSAL_BODY
)


def handler_options(config: HubConfig) -> dict[str, Any]:
    """Keyword arguments of aiohttp's connection handler for `config`."""
    return {
        "keepalive_timeout": config.keepalive_timeout_s,
        "max_line_size": config.max_request_line_bytes,
        "max_field_size": config.max_header_bytes,
        "max_headers": config.max_headers,
        "lingering_time": config.lingering_time_s,
        # No endpoint reads a body, yet one is drained after the answer: never gunzip it (a
        # "Content-Encoding: gzip" body that is not gzip would be a traceback in the log, and a
        # compressed one seconds of the event loop's CPU).
        "auto_decompress": False,
        # The access log is written by the observe middleware and, for
        # requests the parser refuses, by HubRequestHandler.handle_error.
        "access_log": None,
    }


# --------------------------------------------------------------- parser errors

# llhttp's messages: its own description of the error, then the bytes it choked on.
_LLHTTP_MESSAGE_RE: Final = re.compile(r"(?:Bad status line:\s+)?([A-Za-z][A-Za-z0-9 ,.()_-]{0,99}):\n\n  b['\"]")
_TLS_ON_PLAIN_PORT: Final = "Received HTTPS traffic on an HTTP port"
# aiohttp's errors whose messages quote the request (a header line, the URL).
_QUOTING_ERRORS: Final = (
    (LineTooLong, "a request line or header is too long"),
    (InvalidURLError, "malformed request target"),
    (InvalidHeader, "malformed header"),
    (BadStatusLine, "malformed request line"),
)


def parser_reason(exc: HttpProcessingError) -> str:
    """Why the HTTP parser refused a request, for the log and the 400 answer: its own
    words, never the request bytes it quotes (a header line with a token, a URL)."""
    message = exc.message if isinstance(exc.message, str) else ""
    if message == _TLS_ON_PLAIN_PORT:
        return "TLS on a plain HTTP port"
    match = _LLHTTP_MESSAGE_RE.match(message)
    if match is not None:
        return match.group(1)
    for error_type, reason in _QUOTING_ERRORS:
        if isinstance(exc, error_type):
            return reason
    if type(exc) is BadHttpMessage and message.isprintable() and "b'" not in message and len(message) <= 100:
        return message  # one of the pure-Python parser's fixed texts ("Too many headers received")
    return "malformed request"


# --------------------------------------------------------------- connections


def default_per_client(max_connections: int) -> int:
    """--max-connections-per-client when not given: half the total, so that two
    clients never take every connection."""
    return max(1, max_connections // 2)


class ConnectionLimits:
    """What all connections of one listening socket share."""

    def __init__(self, config: HubConfig, metrics: HubMetrics, ssl_context: ssl.SSLContext | None = None) -> None:
        # TLS is started by each connection once it is counted (HubRequestHandler), so that
        # the limits hold for connections still in their handshake too.
        self.ssl_context = ssl_context
        self.max_connections = config.max_connections
        self.max_per_client = config.max_connections_per_client or default_per_client(config.max_connections)
        self._per_client: collections.Counter[str] = collections.Counter()  # open connections by address
        self.header_timeout_s = config.header_timeout_s
        self.send_timeout_ms = max(1, round(config.send_timeout_s * 1000))
        self.metrics = metrics
        self.access_log = config.access_log
        self.open_connections = 0
        self._refusal_logged_at: float | None = None
        self._refused_since_log = 0

    def admit(self, client: str) -> bool:
        """Count a new connection from `client` (its address) in, unless a limit is reached."""
        if self.open_connections >= self.max_connections:
            self._refused(f"{self.open_connections} open, the most --max-connections allows")
            return False
        if self._per_client[client] >= self.max_per_client:
            self._refused(f"{self._per_client[client]} open from {client}, the most --max-connections-per-client allows")
            return False
        self.open_connections += 1
        self._per_client[client] += 1
        self.metrics.open_connections.inc()
        return True

    def release(self, client: str) -> None:
        self.open_connections -= 1
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]
        self.metrics.open_connections.dec()

    def _refused(self, why: str) -> None:
        self.metrics.refused_connections.inc()
        self._refused_since_log += 1
        now = time.monotonic()
        if self._refusal_logged_at is None or now - self._refusal_logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning("refusing connections: %s (%d refused since the last report)", why, self._refused_since_log)
            self._refusal_logged_at = now
            self._refused_since_log = 0


class HubRequestHandler(RequestHandler):
    """aiohttp's connection handler plus the connection limit (counted when the TCP
    connection opens, before any TLS handshake), the TLS handshake, the request head
    timeout and JSON answers to malformed requests."""

    def __init__(self, manager: web.Server, limits: ConnectionLimits, **options: Any) -> None:
        super().__init__(manager, loop=asyncio.get_running_loop(), **options)
        self._limits = limits
        self._admitted = False  # counted in the limits until released
        self._connected = False  # handed to aiohttp (after the TLS handshake, with TLS)
        self._lost = False
        self._client = ""  # the peer's address
        # Set on a refused connection until its 503 is written.
        self._refused_transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._handshake: asyncio.Task[None] | None = None
        # Decrypted bytes that arrived with the end of the handshake, before the handler ran.
        self._early_data: list[bytes] = []

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = _peer_address(transport)
        self._client = client_of(address[0]) if address is not None else "-"
        if not self._limits.admit(self._client):
            if self._limits.ssl_context is not None:
                transport.close()  # nothing can be said before a handshake, and that is what it spares
                return
            self._refused_transport = transport  # type: ignore[assignment]
            self._timer = self._loop.call_later(_REFUSAL_GRACE_S, self._send_refusal)
            return
        self._admitted = True
        _set_send_timeout(transport, self._limits.send_timeout_ms)
        if self._limits.ssl_context is None:
            self._connect(transport)
        else:
            self._handshake = self._loop.create_task(self._start_tls(transport))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            self._send_refusal()
            return
        if not self._connected:
            self._early_data.append(data)
            return
        if not self._in_request and self._timer is None:
            self._start_header_timer()
        super().data_received(data)

    def eof_received(self) -> None:
        if self._connected:
            super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_timer()
        self._refused_transport = None
        self._lost = True
        self._release()
        if self._connected:
            self._connected = False
            super().connection_lost(exc)

    # -- the connection's life

    async def _start_tls(self, transport: asyncio.Transport) -> None:
        """The TLS handshake, bounded by the header timeout; then the connection is served.
        A failed handshake ends it (its slot in the limits is given back)."""
        assert self._limits.ssl_context is not None
        tls_transport: asyncio.Transport | None = None
        try:
            tls_transport = await self._loop.start_tls(
                transport,
                self,
                self._limits.ssl_context,
                server_side=True,
                ssl_handshake_timeout=self._limits.header_timeout_s,
            )
        except Exception as exc:  # the handshake failed or timed out; the transport is closed
            log.debug("TLS handshake with %s failed: %s", self._client, exc)
        finally:
            if tls_transport is None or self._lost:
                self._release()
        if tls_transport is None or self._lost:
            return
        self._connect(tls_transport)
        early, self._early_data = self._early_data, []
        for data in early:
            self.data_received(data)

    def _connect(self, transport: asyncio.BaseTransport) -> None:
        """Hand the (TLS) connection to aiohttp; its first request head is due within the timeout."""
        self._connected = True
        super().connection_made(transport)
        self._start_header_timer()

    def _release(self) -> None:
        """Give the connection's place in the limits back (once)."""
        if self._admitted:
            self._admitted = False
            self._limits.release(self._client)

    # -- called by the observe middleware

    def request_started(self) -> None:
        """A request head is complete and its handler runs."""
        self._in_request = True
        self._cancel_timer()

    def request_finished(self) -> None:
        """The response is sent; the next byte starts a new request head."""
        self._in_request = False

    # -- aiohttp

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer a request the parser refused (or an error that escaped the
        middlewares) with JSON; log and count it. Never a traceback."""
        if isinstance(exc, ConnectionError) or request.writer.output_size > 0:
            # The client is gone, or a response is half sent: close.
            raise ConnectionError("client went away or response already started")
        if isinstance(exc, HttpProcessingError):
            reason = parser_reason(exc)
            log.info("malformed request from %s: %s", request.remote, reason)
            response = json_error(status, f"bad request: {reason}")
            body_bytes = response.content_length or 0
            self._limits.metrics.observe_request(ENDPOINT_MALFORMED, str(status), 0.0, body_bytes)
            if self._limits.access_log:
                log_access(request, "-", str(status), body_bytes, 0.0)
        else:
            log.error("error answering a request from %s", request.remote, exc_info=exc)
            response = json_error(status, "internal server error" if status >= 500 else "bad request")
        response.headers[hdrs.SERVER] = SERVER_HEADER
        response.force_close()
        return response

    # -- timers

    def _start_header_timer(self) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(self._limits.header_timeout_s, self._header_timed_out)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timed_out(self) -> None:
        self._timer = None
        transport = self.transport
        if self._in_request or transport is None:
            return
        self._limits.metrics.header_timeouts.inc()
        log.info(
            "closing connection from %s: no complete request head within %g s",
            _peer(transport),
            self._limits.header_timeout_s,
        )
        self.force_close()

    def _send_refusal(self) -> None:
        self._cancel_timer()
        transport = self._refused_transport
        self._refused_transport = None
        if transport is not None and not transport.is_closing():
            transport.write(_REFUSAL_RESPONSE)
            transport.close()


def _set_send_timeout(transport: asyncio.BaseTransport, timeout_ms: int) -> None:
    """Have the kernel abort the connection once sent data stays
    unacknowledged (or the peer's window stays shut) for `timeout_ms`."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    sock = transport.get_extra_info("socket")
    if option is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, timeout_ms)
    except OSError as exc:
        log.debug("cannot set TCP_USER_TIMEOUT: %s", exc)


def _peer_address(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
    """The client's (host, port), None for a socket without one."""
    peer = transport.get_extra_info("peername")
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) and len(peer) >= 2 else None


def _peer(transport: asyncio.BaseTransport) -> str:
    address = _peer_address(transport)
    return f"{address[0]}:{address[1]}" if address is not None else "-"


class AcceptErrorReporter:
    """The event loop's exception handler: asyncio reports every failed accept() for want
    of descriptors or memory (about a hundred a second, each with a traceback); this makes
    them one warning line per interval. Anything else goes to the default handler."""

    def __init__(self) -> None:
        self._logged_at: float | None = None
        self._since_log = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and context.get("message", "").startswith("socket.accept() out of")):
            loop.default_exception_handler(context)
            return
        self._since_log += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= _REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "cannot accept connections: %s (%d failed accepts since the last report); "
                "new connections wait until descriptors are free",
                exc.strerror or exc,
                self._since_log,
            )
            self._logged_at = now
            self._since_log = 0


async def start_server(
    runner: web.AppRunner,
    config: HubConfig,
    metrics: HubMetrics,
    sock: Any,
    ssl_context: ssl.SSLContext | None,
) -> asyncio.Server:
    """Listen on `sock` with a HubRequestHandler per connection. The
    caller closes the returned server before `runner.cleanup()`, which
    then shuts the open connections down."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    limits = ConnectionLimits(config, metrics, ssl_context)
    options = handler_options(config)

    def make_handler() -> HubRequestHandler:
        return HubRequestHandler(server, limits, **options)

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptErrorReporter())
    # No ssl= here: each connection starts TLS itself once it is counted in the limits.
    return await loop.create_server(make_handler, sock=sock)
