"""What a log line shows of a request: text escaped, the query only when it is the protocol's, never a token."""

from __future__ import annotations

import logging
import re
from typing import Final

from aiohttp import web

# One INFO line per answered request (docs/protocol.md), apart from the hub's own log.
ACCESS_LOG: Final = logging.getLogger("hubserver.access")


def printable(text: str, limit_chars: int = 200) -> str:
    """`text` made safe for one log line: control and non-printable
    characters escaped, cut to `limit_chars`."""
    if len(text) > limit_chars:
        text = text[:limit_chars] + "..."
    if text.isprintable():
        return text
    return repr(text)[1:-1]


# Query parameters of the protocol and what their values look like (ids, versions,
# numbers): a query of only these is logged as sent, any other is not logged at all, as
# it may carry a secret (a token someone put in the URL, ?access_token=...).
_LOGGABLE_QUERY_RE: Final = re.compile(r"(?:(?:v|bs|first|count|f)=[0-9a-f.,]*)(?:&(?:v|bs|first|count|f)=[0-9a-f.,]*)*")
REDACTED_QUERY: Final = "<query redacted>"
# The user and password of an absolute-form request target (`GET http://user:pass@host/...`).
_USERINFO_RE: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def loggable_target(request: web.BaseRequest) -> str:
    """The request target for a log line: the path (without the user and password an
    absolute-form target may carry), and the query only if it is made of the protocol's
    parameters (else REDACTED_QUERY), escaped and cut as by `printable`."""
    path, sep, query = request.raw_path.partition("?")
    if sep and not _LOGGABLE_QUERY_RE.fullmatch(query):
        query = REDACTED_QUERY
    path = _USERINFO_RE.sub(r"\1", path)
    return printable(path + sep + query, 300)


def log_access(request: web.BaseRequest, identity: str, status: str, body_bytes: int, duration_s: float) -> None:
    """One access-log line: client address, identity (a token's NAME, a
    client certificate's cn=..., or -), request line, status, body bytes,
    seconds. Never a token: the query is left out unless it is the protocol's (see
    `loggable_target`), and headers are not logged."""
    if not ACCESS_LOG.isEnabledFor(logging.INFO):
        return
    version = request.version
    ACCESS_LOG.info(
        '%s %s "%s %s HTTP/%d.%d" %s %d %.6f',
        request.remote or "-",
        identity,
        printable(request.method, 20),
        loggable_target(request),
        version.major,
        version.minor,
        status,
        body_bytes,
        duration_s,
    )
