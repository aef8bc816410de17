"""The ``cachefs-hub`` command: argument parsing and user-facing errors."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from hubserver.config import DEFAULT_LISTEN, LOG_LEVELS, HubConfig

LOG = logging.getLogger(__name__)

PROG = "cachefs-hub"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """A problem the user can fix; reported as one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}\n")


def parse_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[IPV6]:PORT`` for IPv6) into host and port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"listen address {value!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"listen address {value!r}: write an IPv6 host in brackets, as [::1]:PORT")
    if not host or any(c.isspace() or c in "[]/@" for c in host):
        raise argparse.ArgumentTypeError(f"listen address {value!r}: bad host {host!r}")
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise argparse.ArgumentTypeError(f"listen address {value!r}: port must be a number from 0 to 65535")
    return host, int(port_text)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``cachefs-hub``."""
    parser = _Parser(
        prog=PROG,
        description="Serve one dataset directory, read-only, to cachefs spokes over HTTP.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="scan a directory and serve it",
        description=(
            "Scan DIR once into a snapshot and serve it (protocol version 1: "
            "/healthz, /v1/manifest, /v1/files/ID). Once listening, prints "
            f"'{PROG} listening on http://HOST:PORT' on stdout; logs go to "
            "stderr. Stops cleanly on SIGTERM or SIGINT."
        ),
    )
    serve.add_argument("--root", required=True, type=Path, metavar="DIR", help="dataset directory")
    serve.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        type=parse_listen,
        metavar="HOST:PORT",
        help=f"address to listen on, [IPV6]:PORT for IPv6; port 0 picks a free port (default: {DEFAULT_LISTEN})",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LOG_LEVELS,
        help="stderr log level (default: info)",
    )
    return parser


def check_root(root: Path) -> Path:
    """The root as an absolute path; raises UserError if it cannot be served."""
    if not root.exists():
        raise UserError(f"root {root} does not exist")
    if not root.is_dir():
        raise UserError(f"root {root} is not a directory")
    try:
        with os.scandir(root):
            pass
    except OSError as exc:
        raise UserError(f"root {root} is not readable: {exc.strerror}") from None
    return root.absolute()


def _bind_error(host: str, port: int, exc: OSError) -> str:
    where = f"cannot listen on {_format_host(host)}:{port}"
    if isinstance(exc, socket.gaierror):
        return f"{where}: unknown host ({exc.strerror})"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: address already in use"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: address not available on this machine"
    return f"{where}: {exc.strerror or exc}"


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def _wait_for_stop_signal() -> signal.Signals:
    """Return the first SIGTERM or SIGINT received."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(signum: signal.Signals) -> None:
        if not received.done():
            received.set_result(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await received
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the hub's socket, before the possibly long scan,
    so that a bad host or a busy port is reported at once. Binds the first
    address the host resolves to. Raises UserError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(_bind_error(host, port, exc)) from None
    family, sock_type, proto, _, address = infos[0]
    sock = socket.socket(family, sock_type, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(_bind_error(host, port, exc)) from None
    return sock


async def serve(config: HubConfig, sock: socket.socket) -> int:
    """Scan, listen on ``sock``, announce the address, serve until
    SIGTERM/SIGINT."""
    # Imported here: aiohttp takes half a second to import, which --help and
    # the one-line usage errors have no need to wait for.
    from aiohttp import web

    from hubserver.app import make_app

    runner = web.AppRunner(
        make_app(config),
        access_log=logging.getLogger("aiohttp.access") if config.access_log else None,
        keepalive_timeout=config.keepalive_timeout_s,
        shutdown_timeout=config.shutdown_timeout_s,
    )
    try:
        await runner.setup()
    except OSError as exc:
        raise UserError(f"cannot scan root {config.root}: {exc.strerror or exc}") from None
    try:
        await web.SockSite(runner, sock).start()
        host, port = sock.getsockname()[:2]
        print(f"{PROG} listening on http://{_format_host(host)}:{port}", flush=True)
        signum = await _wait_for_stop_signal()
        LOG.info("received %s, shutting down", signum.name)
    finally:
        await runner.cleanup()
    LOG.info("stopped")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cachefs-hub``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        root = check_root(args.root)
        host, port = args.listen
        config = HubConfig(root=root, host=host, port=port, log_level=args.log_level)
        with bind_socket(config.host, config.port) as sock:
            _configure_logging(config.log_level)
            return asyncio.run(serve(config, sock))
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
