"""Options of the hub, as one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Loopback only: the hub has no authentication, so exposing a dataset to the
# network must be a deliberate `--listen 0.0.0.0:PORT`.
DEFAULT_HOST = "127.0.0.1"
# Not assigned to any well-known service; easy to remember next to 8080.
DEFAULT_PORT = 8470
DEFAULT_LISTEN = f"{DEFAULT_HOST}:{DEFAULT_PORT}"
LOG_LEVELS = ("debug", "info", "warning", "error")


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
    # An idle keep-alive connection is closed after this long; spokes keep
    # pools of connections, and a stuck or vanished peer must not hold one
    # (and its file descriptor) for aiohttp's default of an hour.
    keepalive_timeout_s: float = 75.0
    # On SIGTERM, in-flight requests get this long before being cut: long
    # enough for a few range reads, short enough for a prompt restart.
    shutdown_timeout_s: float = 5.0
    # The gzip manifest is written to the socket in pieces of about this many
    # compressed bytes: large enough to amortise a write, small enough to
    # stream a million-entry manifest in constant memory.
    manifest_chunk_bytes: int = 64 * 1024
    # One access-log line per request (logger "aiohttp.access", level INFO).
    access_log: bool = True
