"""The hub's middlewares, each wrapping every request for one job: its record, JSON errors, the HTTP version, its token."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from hubserver.access_log import log_access, loggable_target
from hubserver.auth import IDENTITY_KEY, HubAuth, RefusalLog, bearer_token, client_cert_name
from hubserver.clients import request_client
from hubserver.errors import HubHTTPError
from hubserver.handlers import BODY_BYTES_KEY, endpoint_of, json_error
from hubserver.metrics import (
    AUTH_INVALID,
    AUTH_MALFORMED,
    AUTH_MISSING,
    ENDPOINT_HEALTHZ,
    ENDPOINT_METRICS,
    ENDPOINT_RESCAN,
    STATUS_CLIENT_CLOSED,
    HubMetrics,
)
from hubserver.server import HubRequestHandler

log = logging.getLogger(__name__)

_REALM: Final = "cachefs-hub"


def chain(metrics: HubMetrics, auth: HubAuth, access_log: bool) -> list[Middleware]:
    """The hub's middlewares, outermost first: record every answer, make errors JSON, refuse
    HTTP versions but 1.x, then check credentials, so that a 401 is counted and logged like any answer."""
    return [observe_middleware(metrics, access_log), error_middleware, http_version_middleware, auth_middleware(auth, metrics)]


# --------------------------------------------------------------- observe: metrics and access log


def _identity(request: web.BaseRequest) -> str:
    return request.get(IDENTITY_KEY) or client_cert_name(request) or "-"


def _body_bytes(request: web.Request, response: web.StreamResponse) -> int:
    if request.method == hdrs.METH_HEAD:
        return 0
    if response.content_length is not None:
        return response.content_length
    return request[BODY_BYTES_KEY] if BODY_BYTES_KEY in request else 0


def observe_middleware(metrics: HubMetrics, access_log: bool = True) -> Middleware:
    """The outermost middleware: sends the response itself, so that the duration and byte
    count it records (metrics, and the access-log line if `access_log`) cover the whole body;
    tells the connection when a request is in progress (its request head timeout)."""

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        connection = request.protocol if isinstance(request.protocol, HubRequestHandler) else None
        if connection is not None:
            connection.request_started()
        status = STATUS_CLIENT_CLOSED
        body_bytes = 0
        try:
            response = await handler(request)
            await response.prepare(request)
            await response.write_eof()
            status = str(response.status)
            body_bytes = _body_bytes(request, response)
            return response
        except (ConnectionError, asyncio.CancelledError):
            raise
        except TimeoutError as exc:
            # ETIMEDOUT from the socket: the kernel gave up on a client that
            # accepted no data for --send-timeout. It went away, in effect.
            log.info("cut the response to %s: it accepted no data for --send-timeout", request.remote)
            raise ConnectionResetError("send timeout") from exc
        except Exception:
            status = "500"
            raise
        finally:
            duration_s = time.monotonic() - started
            metrics.observe_request(endpoint_of(request), status, duration_s, body_bytes)
            if access_log:
                log_access(request, _identity(request), status, body_bytes, duration_s)
            if connection is not None:
                connection.request_finished()

    return observe


# --------------------------------------------------------------- errors: JSON, never a traceback


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error as JSON; never send a traceback. A client that
    went away is not an error here: ConnectionError passes through."""
    try:
        return await handler(request)
    except HubHTTPError as exc:
        return json_error(exc.status, exc.message, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers: dict[str, str] = {}
        if hdrs.ALLOW in exc.headers:
            headers[hdrs.ALLOW] = exc.headers[hdrs.ALLOW]
        return json_error(exc.status, exc.reason, headers)
    except ConnectionError:
        raise
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, loggable_target(request))
        return json_error(500, "internal server error")


@web.middleware
async def http_version_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse (505) any HTTP major version but 1: the hub speaks HTTP/1.x."""
    if request.version.major != 1:
        return json_error(505, "HTTP version not supported: the hub speaks HTTP/1.1")
    return await handler(request)


# --------------------------------------------------------------- tokens


_REASON_TEXT: Final = {
    AUTH_MISSING: "no Authorization header",
    AUTH_MALFORMED: "Authorization is not one 'Bearer <token>'",
    AUTH_INVALID: "unknown token",
}


def _unauthorized(reason: str) -> web.Response:
    challenge = f'Bearer realm="{_REALM}"'
    if reason != AUTH_MISSING:
        challenge += ', error="invalid_token"'
    return json_error(
        401,
        f"authentication required: {_REASON_TEXT[reason]}",
        {hdrs.WWW_AUTHENTICATE: challenge},
    )


def auth_middleware(auth: HubAuth, metrics: HubMetrics) -> Middleware:
    """The middleware that answers 401 to requests without a valid token.

    /healthz is always open; /metrics needs a token of `auth.metrics` if
    set; POST /v1/rescan one of `auth.admin` (and is refused, 403, on a hub
    with data tokens but no admin tokens: a data token does not allow it); any
    other path (unknown ones too, so that nothing can be probed) needs a token
    of `auth.data` if set. A client's 401s are logged at most once a minute
    (RefusalLog), and all counted.
    """
    refusals = RefusalLog()

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = endpoint_of(request)
        if endpoint == ENDPOINT_HEALTHZ:
            return await handler(request)
        store = auth.data
        if endpoint == ENDPOINT_METRICS:
            store = auth.metrics
        elif endpoint == ENDPOINT_RESCAN:
            if auth.admin is None and auth.data is not None:
                return json_error(403, "POST /v1/rescan needs an admin token, and this hub has no --admin-token-file")
            store = auth.admin
        if store is None:
            return await handler(request)
        token, reason = bearer_token(request)
        name = store.identify(token) if token is not None else None
        if name is None:
            reason = reason or AUTH_INVALID
            metrics.auth_failures.labels(endpoint, reason).inc()
            unlogged = refusals.due(request_client(request), time.monotonic())
            if unlogged is not None:
                log.warning(
                    "rejected %s %s from %s: %s (%d more refused from this client since its last report; "
                    "at most one report a minute)",
                    request.method,
                    loggable_target(request),
                    request.remote,
                    _REASON_TEXT[reason],
                    unlogged,
                )
            return _unauthorized(reason)
        request[IDENTITY_KEY] = name
        return await handler(request)

    return check_token
