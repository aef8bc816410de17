"""Options of the hub, as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Loopback by default: exposing a dataset to the network must be a deliberate
# `--listen 0.0.0.0:PORT`, and should come with --token-file and TLS.
DEFAULT_HOST = "127.0.0.1"
# Not assigned to any well-known service; easy to remember next to 8080.
DEFAULT_PORT = 8470
DEFAULT_LISTEN = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
LOG_LEVELS = ("debug", "info", "warning", "error")
# A spoke keeps 16 connections by default; this admits a few dozen spokes
# while keeping the hub well inside a 1024 file descriptor limit.
DEFAULT_MAX_CONNECTIONS = 512
# A spoke sends a request head (well under 1 KiB) in one write; ten seconds
# is generous for any real client on any WAN and short for a slowloris.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# An idle keep-alive connection is closed after this long; spokes keep pools
# of connections, and a stuck or vanished peer must not hold one (and its
# file descriptor) for aiohttp's default of an hour.
DEFAULT_IDLE_TIMEOUT_S = 75.0
# A response the client has not accepted a byte of for this long is cut
# (a stalled or deliberately slow reader). A spoke gives up on a read long
# before: its --fetch-timeout defaults to 30 s.
DEFAULT_SEND_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class HubConfig:
    """Everything the hub needs to serve one dataset directory."""

    # The dataset directory; scanned once at start, served read-only.
    root: Path
    # Interface to bind; see DEFAULT_HOST for why loopback.
    host: str = DEFAULT_HOST
    # TCP port; 0 asks the kernel for a free one (printed once listening).
    port: int = DEFAULT_PORT
    # Python logging level name for the stderr log.
    log_level: str = "info"
    # Requests carry no body: anything larger than this is refused.
    client_max_size_bytes: int = 4096
    # See DEFAULT_IDLE_TIMEOUT_S.
    keepalive_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    # On SIGTERM, in-flight requests get this long before being cut: long
    # enough for a few range reads, short enough for a prompt restart.
    shutdown_timeout_s: float = 5.0
    # The gzip manifest is written to the socket in pieces of about this many
    # compressed bytes: large enough to amortise a write, small enough to
    # stream a million-entry manifest in constant memory.
    manifest_chunk_bytes: int = 64 * 1024
    # One access-log line per request (logger "hubserver.access", level INFO).
    access_log: bool = True

    # --- authentication and TLS (all off by default) ---------------------
    # NAME:TOKEN lines; when set, every endpoint but /healthz and /metrics
    # needs `Authorization: Bearer TOKEN`. Reloaded on SIGHUP.
    token_file: Path | None = None
    # Rescan the root this often, publishing a new generation (None: only
    # on SIGUSR1 or POST /v1/rescan).
    rescan_interval_s: float | None = None
    # Same format; when set, /metrics needs a token from this file.
    metrics_token_file: Path | None = None
    # Same format; when set, POST /v1/rescan needs a token from this file (a
    # data token does not allow it). Without it, rescans over HTTP are refused
    # when token_file is set, open otherwise.
    admin_token_file: Path | None = None
    # PEM certificate chain and private key: serve HTTPS instead of HTTP.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # PEM CA bundle: every client must present a certificate it signed.
    tls_client_ca: Path | None = None

    # --- limits against hostile or broken clients -------------------------
    # Connections beyond this many get a 503 and are closed.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # ... and beyond this many from one client address (None: half of
    # max_connections), so that two clients cannot take them all. A regional
    # cache in front of the hub is one address for all its spokes.
    max_connections_per_client: int | None = None
    # A connection must finish its TLS handshake this soon after it opens, and
    # deliver a complete request head this soon after that and after the first
    # byte of each later request; see DEFAULT_HEADER_TIMEOUT_S.
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # See DEFAULT_SEND_TIMEOUT_S; enforced by the kernel (TCP_USER_TIMEOUT,
    # Linux), so it also covers sendfile.
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S
    # The request line holds a 16-digit id and a 16-digit version: 4 KiB
    # leaves room for any URL prefix a proxy adds, and no more.
    max_request_line_bytes: int = 4096
    # The longest header a spoke sends is Authorization with one token.
    max_header_bytes: int = 4096
    # A spoke sends five headers; proxies add a few.
    max_headers: int = 32
    # A request body nobody asked for is read (and dropped) at most this
    # long before the connection is closed.
    lingering_time_s: float = 2.0
