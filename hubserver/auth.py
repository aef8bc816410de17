"""Who a client is: the name of its bearer token (from token files reloaded on SIGHUP), or of its TLS certificate.

A token file has one `NAME:TOKEN` per line; `#` starts a comment line,
blank lines are skipped. NAME identifies the client in logs; TOKEN is what
it sends as `Authorization: Bearer TOKEN`. Several lines are allowed so a
token can be rotated without downtime: add the new one, SIGHUP, move the
clients over, remove the old one, SIGHUP.

Only SHA-256 digests of the tokens are kept in memory, and a presented token
is compared (`hmac.compare_digest`, digest against digest, so neither its
content nor its length shows in the timing) with every configured one
without stopping at a match. A token is never logged, and no error message
quotes one.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import hdrs, web

from hubserver.access_log import printable
from hubserver.config import HubConfig
from hubserver.errors import TokenFileError
from hubserver.metrics import (
    AUTH_MALFORMED,
    AUTH_MISSING,
    HubMetrics,
)

log = logging.getLogger(__name__)

IDENTITY_KEY: Final = web.RequestKey("identity", str)
"""Who made the request: the token's NAME, set once it is accepted."""

# RFC 6750 b64token; long enough to be unguessable.
_TOKEN_RE: Final = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]*")
MIN_TOKEN_CHARS: Final = 16
MAX_TOKEN_CHARS: Final = 1024
MAX_NAME_CHARS: Final = 64
# A token file is a handful of lines; anything this large is a mistake.
MAX_TOKEN_FILE_BYTES: Final = 1024 * 1024
# Others may have no access: the file holds secrets. Nor may the group, unless
# the file is owned by root or the hub and its group is one of the hub's and
# may only read it: a Kubernetes Secret mounted with fsGroup is root:fsGroup
# 0440 (PostgreSQL allows its key file the same way).
_OTHERS_BITS: Final = 0o007
_GROUP_BITS: Final = 0o070
_GROUP_READ: Final = 0o040


@dataclass(frozen=True, slots=True)
class Token:
    name: str
    sha256: bytes


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


def parse_tokens(text: str, source: str) -> tuple[Token, ...]:
    """Parse the content of a token file; raises TokenFileError."""
    tokens: list[Token] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source} line {number}"
        name, sep, token = line.partition(":")
        name, token = name.strip(), token.strip()
        if not sep:
            raise TokenFileError(f"{where}: expected NAME:TOKEN")
        if not name or len(name) > MAX_NAME_CHARS or not _NAME_RE.fullmatch(name):
            raise TokenFileError(
                f"{where}: NAME must be 1 to {MAX_NAME_CHARS} letters, digits or . _ @ -, "
                "starting with a letter or digit"
            )
        if not _TOKEN_RE.fullmatch(token):
            raise TokenFileError(f"{where}: TOKEN must be letters, digits and - . _ ~ + / (optionally ending in =)")
        if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
            raise TokenFileError(f"{where}: TOKEN must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters long")
        if name in names:
            raise TokenFileError(f"{where}: name {name!r} appears twice")
        digest = _digest(token)
        if digest in digests:
            raise TokenFileError(f"{where}: the token of {name!r} is also listed under another name")
        names.add(name)
        digests.add(digest)
        tokens.append(Token(name, digest))
    if not tokens:
        raise TokenFileError(f"{source}: no NAME:TOKEN line")
    return tuple(tokens)


def _check_private(path: Path, st: os.stat_result) -> None:
    """Refuse a token file others may access, or a group other than the hub's own may read."""
    mode = stat.S_IMODE(st.st_mode)
    group_may_read = (mode & _GROUP_BITS) == _GROUP_READ and st.st_uid in (0, os.geteuid()) and (
        st.st_gid == os.getegid() or st.st_gid in os.getgroups())
    if mode & _OTHERS_BITS or (mode & _GROUP_BITS and not group_may_read):
        raise TokenFileError(
            f"token file {path} is accessible by others or by a group not the hub's own "
            f"(mode {mode:04o}); run: chmod 600 {path}"
        )


def read_token_file(path: Path) -> tuple[Token, ...]:
    """Read and parse a token file. Refuses one that others may access, or a group
    other than the hub's own (_check_private). Raises TokenFileError. Blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"token file {path} is not a regular file")
        _check_private(path, st)
        data = f.read(MAX_TOKEN_FILE_BYTES + 1)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise TokenFileError(f"token file {path} is larger than {MAX_TOKEN_FILE_BYTES} bytes")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TokenFileError(f"{path} line {line}: not ASCII") from None
    return parse_tokens(text, str(path))


class TokenStore:
    """The tokens of one token file; `reload` swaps them atomically."""

    def __init__(self, path: Path, tokens: tuple[Token, ...]) -> None:
        self.path = path
        self._tokens = tokens

    @classmethod
    def load(cls, path: Path) -> TokenStore:
        """Read `path`; raises TokenFileError."""
        return cls(path, read_token_file(path))

    @property
    def names(self) -> list[str]:
        return [token.name for token in self._tokens]

    def reload(self) -> None:
        """Read the file again. On error the current tokens stay in force
        and TokenFileError is raised."""
        self._tokens = read_token_file(self.path)

    def identify(self, token: str) -> str | None:
        """The NAME of `token` (a well-formed b64token), or None. Every
        configured token is compared, in constant time each."""
        presented = _digest(token)
        found: str | None = None
        for candidate in self._tokens:
            if hmac.compare_digest(candidate.sha256, presented):
                found = candidate.name
        return found


@dataclass(frozen=True, slots=True)
class HubAuth:
    """Which token store guards which endpoints. None: open."""

    # Everything except /healthz, /metrics and POST /v1/rescan.
    data: TokenStore | None = None
    # /metrics.
    metrics: TokenStore | None = None
    # POST /v1/rescan. Without it, rescans are open only on a hub without data tokens.
    admin: TokenStore | None = None

    @classmethod
    def from_config(cls, config: HubConfig) -> HubAuth:
        """Load the configured token files; raises TokenFileError."""
        return cls(
            data=TokenStore.load(config.token_file) if config.token_file else None,
            metrics=TokenStore.load(config.metrics_token_file) if config.metrics_token_file else None,
            admin=TokenStore.load(config.admin_token_file) if config.admin_token_file else None,
        )

    def stores(self) -> list[TokenStore]:
        return [store for store in (self.data, self.metrics, self.admin) if store is not None]

    def reload(self, metrics: HubMetrics | None = None) -> None:
        """Reload every token file (SIGHUP); log the outcome of each."""
        if not self.stores():
            log.info("SIGHUP: no token file to reload")
        for store in self.stores():
            try:
                store.reload()
            except TokenFileError as exc:
                log.error("SIGHUP: %s; the tokens loaded before stay in force", exc)
                result = "error"
            else:
                log.info(
                    "SIGHUP: reloaded token file %s: %d tokens (%s)",
                    store.path,
                    len(store.names),
                    ", ".join(store.names),
                )
                result = "ok"
            if metrics is not None:
                metrics.token_reloads.labels(result).inc()


def bearer_token(request: web.BaseRequest) -> tuple[str | None, str]:
    """The token of the request's `Authorization: Bearer` header, or None
    and the reason (AUTH_MISSING or AUTH_MALFORMED)."""
    values = request.headers.getall(hdrs.AUTHORIZATION, [])
    if not values:
        return None, AUTH_MISSING
    if len(values) > 1:
        return None, AUTH_MALFORMED
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not _TOKEN_RE.fullmatch(token) or len(token) > MAX_TOKEN_CHARS:
        return None, AUTH_MALFORMED
    return token, ""


# A client's refusals are logged at most once per this many seconds (a client retrying
# with a bad token must not flood the log); the metrics count every one.
REFUSAL_LOG_INTERVAL_S: Final = 60.0
# Clients whose last logged refusal is remembered; beyond, the ones logged longest ago
# are forgotten (many addresses at once: some may be logged a little more often).
_REFUSAL_LOG_CLIENTS: Final = 10_000


class RefusalLog:
    """When a client's refusal may be logged: once per interval, with how many were not."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self._interval_s = interval_s
        # client -> (when its last refusal was logged, refusals not logged since), oldest first
        self._clients: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def due(self, client: str, now: float) -> int | None:
        """The number of the client's refusals not logged since its last logged one if this
        one is to be logged, else None (and it is counted)."""
        logged_at, unlogged = self._clients.get(client, (None, 0))
        if logged_at is not None and now - logged_at < self._interval_s:
            self._clients[client] = (logged_at, unlogged + 1)
            return None
        self._clients.pop(client, None)
        self._clients[client] = (now, 0)
        while len(self._clients) > _REFUSAL_LOG_CLIENTS:
            self._clients.popitem(last=False)
        return unlogged


def client_cert_name(request: web.BaseRequest) -> str | None:
    """`cn=<common name>` of the client's TLS certificate (mutual TLS), or
    None without one."""
    transport = request.transport
    if transport is None:
        return None
    cert = transport.get_extra_info("peercert")
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return f"cn={printable(value, 64)}"
    return "cn=?"
