"""The `cachefs-hub` command: from its options to a serving hub, with one-line errors for the user."""

from __future__ import annotations

import argparse
import asyncio
import errno
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from cachefs import __version__
from cachefs.config_file import ConfigFileError, with_config_file
from cachefs.sd_notify import sd_notify
from hubserver.config import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SEND_TIMEOUT_S,
    LOG_LEVELS,
    HubConfig,
)
from hubserver.errors import TLSConfigError, TokenFileError, UserError

if TYPE_CHECKING:
    from hubserver.auth import HubAuth

log = logging.getLogger(__name__)

PROG = "cachefs-hub"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {message}\n")


def parse_listen(value: str) -> tuple[str, int]:
    """Split `HOST:PORT` (`[IPV6]:PORT` for IPv6) into host and port."""
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


def _positive_int(value: str) -> int:
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number")
    return int(value)


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e6:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    """The command line of `cachefs-hub`."""
    parser = _Parser(
        prog=PROG,
        description="Serve one dataset directory, read-only, to cachefs spokes over HTTP.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="scan a directory and serve it",
        description=(
            "Scan DIR once into a snapshot and serve it (protocol version 1: "
            "/healthz, /v1/manifest, /v1/files/ID, /v1/files/ID/checksums, /v1/batch, POST /v1/rescan, "
            "/metrics). Once listening, prints "
            f"'{PROG} listening on http://HOST:PORT' (https with TLS) on stdout; logs go to "
            "stderr. Stops cleanly on SIGTERM or SIGINT; SIGHUP reloads the token files; SIGUSR1 rescans the root."
        ),
    )
    serve.add_argument("--root", required=True, type=Path, metavar="DIR", help="dataset directory")
    serve.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML file of these options (keys as the long options: root, listen, token_file, ...); flags override it",
    )
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
    security = serve.add_argument_group("authentication and TLS")
    security.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="require 'Authorization: Bearer TOKEN' on every endpoint but /healthz and /metrics; "
        "FILE has NAME:TOKEN lines (# comments), must not be accessible by others (its group may "
        "only read it, and only if it is one of the hub's groups: a Kubernetes Secret with fsGroup), "
        "and is reloaded on SIGHUP (default: no authentication)",
    )
    security.add_argument(
        "--metrics-token-file",
        type=Path,
        metavar="FILE",
        help="protect /metrics with the tokens of FILE, same format (default: /metrics is open)",
    )
    security.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help="allow POST /v1/rescan to the tokens of FILE, same format; data tokens never allow it "
        "(default: refused with --token-file, open without)",
    )
    security.add_argument("--tls-cert", type=Path, metavar="FILE", help="serve HTTPS with this PEM certificate chain")
    security.add_argument("--tls-key", type=Path, metavar="FILE", help="PEM private key of --tls-cert (unencrypted)")
    security.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="mutual TLS: every client must present a certificate signed by a CA in this PEM file",
    )
    limits = serve.add_argument_group("limits")
    limits.add_argument(
        "--max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"connections beyond N get a 503 and are closed (default: {DEFAULT_MAX_CONNECTIONS})",
    )
    limits.add_argument(
        "--max-connections-per-client",
        type=_positive_int,
        default=None,
        metavar="N",
        help="connections beyond N from one client address (an IPv6 client: its /64) get a 503 and are closed "
        "(default: half of --max-connections; a regional cache or a NAT gateway in front of the spokes "
        "is one client)",
    )
    limits.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request head is not complete this long after it opened, "
        f"or after its first byte (default: {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    limits.add_argument(
        "--send-timeout",
        type=_positive_seconds,
        default=DEFAULT_SEND_TIMEOUT_S,
        metavar="SECONDS",
        help=f"cut a response the client has accepted no data of for this long (default: {DEFAULT_SEND_TIMEOUT_S:g})",
    )
    limits.add_argument(
        "--idle-timeout",
        type=_positive_seconds,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"close a keep-alive connection idle this long between requests (default: {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    parser_rescan = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    parser_rescan.add_argument(
        "--rescan-interval",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="rescan the root this often and publish a new generation (default: only on SIGUSR1 or POST /v1/rescan)",
    )
    for command_parser in (parser, *commands.choices.values()):
        command_parser.allow_abbrev = False  # --conf must not be taken for --config, which is read apart
    return parser


def _check_options_together(args: argparse.Namespace) -> None:
    """Options that only make sense together (TLS files, connection limits); raises UserError."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise UserError("--tls-client-ca needs --tls-cert and --tls-key")
    per_client = args.max_connections_per_client
    if per_client is not None and per_client > args.max_connections:
        raise UserError(
            f"--max-connections-per-client {per_client} is above --max-connections {args.max_connections}: "
            "one client could never have that many; raise --max-connections too"
        )


def check_root(root: Path) -> Path:
    """The root as an absolute path; raises UserError if it cannot be served."""
    try:
        exists, is_dir = root.exists(), root.is_dir()
    except OSError as exc:  # EACCES on a directory above it (Path.exists raises it)
        raise UserError(f"root {root} cannot be looked at: {exc.strerror}") from None
    if not exists:
        raise UserError(f"root {root} does not exist")
    if not is_dir:
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


def exposure_warning(host: str, authenticated: bool, encrypted: bool) -> str | None:
    """What to warn about when the hub listens on `host` (a numeric address) with or
    without client authentication (tokens, client certificates) and TLS: nothing on
    loopback, nor with both."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        loopback = False
    else:
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        loopback = (mapped or address).is_loopback
    if loopback or (authenticated and encrypted):
        return None
    where = f"listening on {_format_host(host)}, not a loopback address,"
    if not authenticated and not encrypted:
        return (
            f"{where} without --token-file or TLS: anyone who can reach it can read the whole dataset, "
            "unencrypted; add --token-file and --tls-cert/--tls-key, or listen on 127.0.0.1"
        )
    if not encrypted:
        return (
            f"{where} without TLS: the spokes' tokens and the data cross the network unencrypted, "
            "and the block checksums do not protect against a man in the middle; add --tls-cert/--tls-key"
        )
    return (
        f"{where} without --token-file or --tls-client-ca: anyone who can reach it can read the whole dataset; "
        "add --token-file"
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the hub's socket, before the possibly long scan,
    so that a bad host or a busy port is reported at once. Binds the first
    address the host resolves to. Raises UserError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(_bind_error(host, port, exc)) from None
    except UnicodeError:  # a label of 64+ characters: no DNS name
        raise UserError(f"cannot listen on {host!r}: not a valid host name or address") from None
    family, sock_type, proto, _, address = infos[0]
    sock = socket.socket(family, sock_type, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(_bind_error(host, port, exc)) from None
    return sock


async def serve(config: HubConfig, auth: HubAuth, ssl_context: ssl.SSLContext | None, sock: socket.socket) -> int:
    """Scan, listen on `sock`, announce the address, serve until
    SIGTERM/SIGINT; reload the token files on SIGHUP."""
    # Imported here: aiohttp takes half a second to import, which --help and
    # the one-line usage errors have no need to wait for.
    from aiohttp import web

    from hubserver.app import METRICS_KEY, make_app
    from hubserver.rescan import SNAPSHOT_KEY
    from hubserver.server import handler_options, start_server

    app = make_app(config, auth)
    metrics = app[METRICS_KEY]
    runner = web.AppRunner(app, shutdown_timeout=config.shutdown_timeout_s, **handler_options(config))
    try:
        await runner.setup()
    except OSError as exc:
        raise UserError(f"cannot scan root {config.root}: {exc.strerror or exc}") from None
    loop = asyncio.get_running_loop()
    server: asyncio.Server | None = None
    loop.add_signal_handler(signal.SIGHUP, auth.reload, metrics)
    holder = app[SNAPSHOT_KEY]
    loop.add_signal_handler(signal.SIGUSR1, lambda: loop.create_task(holder.rescan_logged()))
    try:
        server = await start_server(runner, config, metrics, sock, ssl_context)
        host, port = sock.getsockname()[:2]
        authenticated = auth.data is not None or config.tls_client_ca is not None
        warning = exposure_warning(host, authenticated, ssl_context is not None)
        if warning is not None:
            log.warning("%s", warning)
        scheme = "https" if ssl_context is not None else "http"
        print(f"{PROG} listening on {scheme}://{_format_host(host)}:{port}", flush=True)
        sd_notify("READY=1")  # systemd's Type=notify: units ordered after the hub find it serving
        signum = await _wait_for_stop_signal()
        log.info("received %s, shutting down", signum.name)
        sd_notify("STOPPING=1")
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        loop.remove_signal_handler(signal.SIGUSR1)
        if server is not None:
            server.close()
        await runner.cleanup()
    log.info("stopped")
    return EXIT_OK


def _load_credentials(config: HubConfig) -> tuple[HubAuth, ssl.SSLContext | None]:
    """Read the token files and TLS files now, so that a mistake is one line
    at start and not a surprise at the first request. Raises UserError."""
    from hubserver.auth import HubAuth
    from hubserver.tls import make_ssl_context

    try:
        return HubAuth.from_config(config), make_ssl_context(config)
    except (TokenFileError, TLSConfigError) as exc:
        raise UserError(str(exc)) from None


def _check_installed() -> None:
    """The hub's own dependency, missing from an install without the `hub` extra; raises UserError."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise UserError("aiohttp is not installed: install the hub with `pip install 'cachefs[hub]'`") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `cachefs-hub`; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(with_config_file(list(sys.argv[1:] if argv is None else argv), parser, "serve"))
    except ConfigFileError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    try:
        _check_installed()
        root = check_root(args.root)
        _check_options_together(args)
        host, port = args.listen
        config = HubConfig(
            root=root,
            host=host,
            port=port,
            log_level=args.log_level,
            token_file=args.token_file,
            metrics_token_file=args.metrics_token_file,
            admin_token_file=args.admin_token_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            header_timeout_s=args.header_timeout,
            send_timeout_s=args.send_timeout,
            keepalive_timeout_s=args.idle_timeout,
            rescan_interval_s=args.rescan_interval,
        )
        auth, ssl_context = _load_credentials(config)
        with bind_socket(config.host, config.port) as sock:
            _configure_logging(config.log_level)
            return asyncio.run(serve(config, auth, ssl_context, sock))
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
