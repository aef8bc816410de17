"""The daemon's control socket: operator commands (`cachefs warm`, `unpin`, `evict`, `purge`, `refresh`, `stats`), plans.

A Unix socket `<cache-dir>/control.sock`, mode 0600 in a 0700 directory;
connections from users other than root and the daemon's owner are refused
(checked with SO_PEERCRED). One request per connection, newline-delimited
JSON both ways:

    -> {"command": "warm", "paths": ["shards"], "pin": false, "parallel": 8}
    <- {"progress": {...}}            zero or more
    <- {"ok": true, "result": {...}}  or {"ok": false, "error": "one line"}

Closing the connection cancels the command (a warm-up stops; what it
fetched stays cached, so running it again resumes).

Streaming commands (`plan`, see planner.py) go on sending lines after the
request line; their handlers get the rest of the connection as `Lines`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

import trio

from ..errors import CachefsError

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
MAX_REQUEST_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 10
# Connections waiting to be accepted: every rank of a training job may send its plan at
# once (up to MAX_PLANS), and a client with a timeout is refused at once beyond this.
MAX_WAITING_CONNECTIONS = 256

Progress = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[dict[str, Any], Progress], Awaitable[dict[str, Any]]]


class Lines:
    """The rest of a connection after the request line, read line by line."""

    def __init__(self, stream: trio.SocketStream, buffered: bytes) -> None:
        self._stream = stream
        self._buffer = bytearray(buffered)

    async def receive_line(self, max_bytes: int = MAX_REQUEST_BYTES) -> bytes | None:
        """The next line without its newline; None when the client closed the connection."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            if len(self._buffer) > max_bytes:
                raise CachefsError(f"line longer than {max_bytes} bytes")
            try:
                chunk = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                return None
            self._buffer += chunk


StreamHandler = Callable[[dict[str, Any], Progress, Lines], Awaitable[dict[str, Any]]]


class ControlServer:
    """Serves operator commands with the handlers it is given."""

    def __init__(self, handlers: dict[str, Handler], stream_handlers: dict[str, StreamHandler] | None = None) -> None:
        self._handlers = handlers
        self._stream_handlers = stream_handlers or {}

    async def serve(self, path: Path, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Path operations on a local socket file: instant, at start and stop only.
        path.unlink(missing_ok=True)  # noqa: ASYNC240
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(MAX_WAITING_CONNECTIONS)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._handle, [listener])
        finally:
            path.unlink(missing_ok=True)  # noqa: ASYNC240

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            if not _peer_allowed(stream.socket):
                await _send(stream, {"ok": False, "error": "permission denied: only root or the daemon's owner"})
                return
            try:
                request, rest = await _receive_request(stream)

                async def progress(report: dict[str, Any]) -> None:
                    await _send(stream, {"progress": report})

                command = str(request.get("command"))
                if command in self._stream_handlers:
                    result = await self._stream_handlers[command](request, progress, Lines(stream, rest))
                elif command in self._handlers:
                    result = await self._handlers[command](request, progress)
                else:
                    raise CachefsError(f"unknown command {request.get('command')!r}")
                reply: dict[str, Any] = {"ok": True, "result": result}
            except CachefsError as exc:
                reply = {"ok": False, "error": str(exc)}
            except trio.TooSlowError:
                log.info("control client sent no complete request within %d s", REQUEST_TIMEOUT_S)
                reply = {"ok": False, "error": f"no complete request within {REQUEST_TIMEOUT_S} s"}
            except Exception as exc:
                if _client_went_away(exc):
                    log.info("control client went away; command cancelled")
                    return
                log.exception("control command failed")
                reply = {"ok": False, "error": "internal error; see the daemon log"}
            try:
                await _send(stream, reply)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def _peer_allowed(sock: trio.socket.SocketType) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid in (0, os.getuid())


async def _receive_request(stream: trio.SocketStream) -> tuple[dict[str, Any], bytes]:
    """The request line, and what the client sent after it."""
    data = b""
    with trio.fail_after(REQUEST_TIMEOUT_S):
        while b"\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_REQUEST_BYTES:
                raise CachefsError("request too large")
    line, _newline, rest = data.partition(b"\n")
    try:
        request = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        raise CachefsError("malformed request") from None
    if not isinstance(request, dict):
        raise CachefsError("malformed request")
    return request, rest


async def _send(stream: trio.SocketStream, message: dict[str, Any]) -> None:
    await stream.send_all(json.dumps(message).encode() + b"\n")


# -- client side (used by the CLI, plain blocking sockets) ----------------------------


def call(
    socket_path: Path,
    request: dict[str, Any],
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Send one command and return its result; raises CachefsError with the daemon's message."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(socket_path))
        except OSError as exc:
            raise CachefsError(f"cannot reach the daemon at {socket_path}: {exc.strerror or exc}") from None
        sock.sendall(json.dumps(request).encode() + b"\n")
        with sock.makefile("rb") as replies:
            try:
                return _result(replies, on_progress)
            except TimeoutError:
                raise CachefsError(f"the daemon at {socket_path} did not answer within {timeout_s:g} s") from None


def _result(replies: BinaryIO, on_progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    """The command's result from the daemon's reply lines (progress reports first)."""
    for line in replies:
        message = json.loads(line)
        if "progress" in message:
            if on_progress is not None:
                on_progress(message["progress"])
            continue
        if not message.get("ok"):
            raise CachefsError(message.get("error", "the daemon refused the command"))
        result: dict[str, Any] = message.get("result", {})
        return result
    raise CachefsError("the daemon closed the connection without an answer")


def _client_went_away(exc: BaseException) -> bool:
    """Whether a command failed only because its client closed the connection (also when the
    error comes out of a command's nursery, in an exception group)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_client_went_away(inner) for inner in exc.exceptions)
    return isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError))
