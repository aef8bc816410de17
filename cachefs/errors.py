"""The spoke's exception types. Lower layers raise these; fs/operations.py maps them to errno."""

from __future__ import annotations


class CachefsError(Exception):
    """Base class; the message is a one-line explanation fit for a user."""


class UsageError(CachefsError):
    """Bad command-line input or environment (mountpoint, cache dir, sizes)."""


class HubError(CachefsError):
    """Talking to the hub failed."""


class HubUnavailable(HubError):
    """Could not connect, or the connection broke or timed out (retryable)."""


class FetchAbandoned(HubUnavailable):
    """The task fetching a block went away (cancelled) before its bytes came: readers that
    were waiting for that fetch fetch the block themselves."""


class HubProtocolError(HubError):
    """The hub answered something malformed or truncated (retryable)."""


class HubStatusError(HubError):
    """The hub answered with an unexpected HTTP status (`from_hub`: with the hub's own JSON
    error, not a page of a proxy or cache node in between)."""

    def __init__(self, status: int, message: str, from_hub: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.from_hub = from_hub

    @property
    def retryable(self) -> bool:
        return self.status >= 500 or self.status == 429


class HubTLSError(HubError):
    """The hub's certificate could not be verified (not retried)."""


class BatchUnsupported(HubError):
    """The hub (or a proxy before it) does not answer batches of small files (not retried)."""


class RemoteFileChanged(HubError):
    """The hub refused a block because the file changed since our snapshot (412)."""


class OpenInAnotherVersion(CachefsError):
    """A file is open in passthrough mode in an older version than the mount now shows."""


class DataFileChanged(CachefsError):
    """A file open in passthrough mode failed its re-verification: no new open may share its data file."""


class CacheDirInUse(CachefsError):
    """Another daemon holds the cache dir lock."""
