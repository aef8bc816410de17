"""The hub's exception types. Lower layers raise these; handlers and middlewares answer them as JSON."""

from __future__ import annotations


class HubError(Exception):
    """Base class; the message is one line, fit for a log or an answer, never holding a secret."""


# --- start-up: reported as one line by the command, no traceback


class UserError(HubError):
    """A problem the user can fix (an option, the root, the listening address)."""


class TokenFileError(HubError):
    """A token file cannot be used; the message names the file and line but never a token."""


class TLSConfigError(HubError):
    """A TLS option cannot be used (a certificate, key or CA file)."""


# --- answering requests


class HubHTTPError(HubError):
    """A protocol error, answered with `json_error` by the error middleware."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class RangeNotSatisfiable(HubError):
    """The Range header is not one satisfiable byte range of the file: 416."""


class FileChangedError(HubError):
    """The file on disk is no longer the one recorded in the snapshot: 412."""


class FileUnavailableError(HubError):
    """The file could not be opened or read for a reason that may pass (no descriptor or
    memory left, an I/O error): not a change, so clients retry (503)."""


class NotInSnapshotError(HubError):
    """A file a batch names is not (or no longer) the snapshot's: 412."""


class RequestAbandoned(HubError):
    """The client went away: its checksums are not hashed further (499)."""
