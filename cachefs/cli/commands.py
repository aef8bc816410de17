"""`cachefs` command line: the parser, mount, unmount (operator commands: admin.py); errors are one line, not a traceback."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import logging
import math
import os
import select
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..cache.store import can_free_space
from ..cache.tenants import DEFAULT_TENANT, TENANTS_DIR, tenant_dir, validate_tenant
from ..config import (
    MountConfig,
    PassthroughMode,
    checked_token,
    parse_group,
    parse_hub_url,
    parse_listen,
    parse_mode,
    parse_size,
    parse_tier,
    parse_user,
    read_option_file,
    read_token,
    validate_block_size,
    validate_tier_slice,
)
from ..config_file import ConfigFileError, with_config_file
from ..errors import CachefsError, UsageError
from ..fs.mountpoints import lazy_unmount, network_file_system, prepare_mountpoint
from ..processes import wait_for_pid
from . import admin as cli_admin

log = logging.getLogger("cachefs")

LOG_FILE = "cachefs.log"
EXIT_USAGE = 2  # argparse's exit code for a bad command line
TOKEN_ENV = "CACHEFS_HUB_TOKEN"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (its subcommands' too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="cachefs",
        description="Read-through caching FUSE filesystem: mount a cachefs hub's dataset, "
        "keeping every block read on local disk.",
    )
    parser.add_argument("--version", action="version", version=f"cachefs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mount = commands.add_parser("mount", help="mount a hub's dataset (read-only)")
    mount.add_argument("hub_url", metavar="HUB_URL", help="the hub, e.g. http://hub.example:8470")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path,
                       help="an existing directory (what it holds is hidden while mounted)")
    mount.add_argument("--cache-dir", required=True, type=Path,
                       help="where cached blocks and metadata live (made 0700; owned by the daemon's user), "
                            "on a local disk or tmpfs: network file systems and ramfs are refused")
    mount.add_argument("--cache-size", default="10G",
                       help="upper bound for cached block bytes; with several --tenant mounts on one cache dir, "
                            "the size they share, the same for each (default: 10G)")
    mount.add_argument(
        "--tenant", metavar="NAME",
        help="share --cache-dir with other mounts, each with its own NAME (letters, digits, '.', '_', '-'); "
             "a second mount of the same NAME is refused (default: the cache dir's own, 'default'; docs/shared-cache.md)",
    )
    mount.add_argument("--cache-min", metavar="SIZE",
                       help="bytes of the shared cache guaranteed to this tenant while mounted: the others never "
                            "evict it below this (default: 0)")
    mount.add_argument("--cache-max", metavar="SIZE",
                       help="the most this tenant may hold of the shared cache (default: all of --cache-size)")
    mount.add_argument("--block-size", default="1M", help="cache block size, a power of two from 64K to 64M (default: 1M)")
    mount.add_argument("--max-connections", type=int, default=64, help="concurrent connections to the hub (default: 64)")
    mount.add_argument(
        "--readahead-blocks", type=int, default=64,
        help="largest read-ahead window of a sequential reader, in blocks; 0 disables read-ahead "
        "and the background fill of randomly read files (default: 64)",
    )
    mount.add_argument(
        "--prefetch-siblings", type=int, default=128, metavar="N",
        help="opening a small file prefetches the next N files in tree order, across directories, "
        "at most 16 MiB, up to 64 files (4 blocks) per request; 0 disables (default: 128)",
    )
    mount.add_argument(
        "--fetch-timeout", type=float, default=30.0, metavar="SECONDS",
        help="a read needing the hub fails with EIO within this long plus up to a second, retries included "
        "(default: 30)",
    )
    mount.add_argument(
        "--refresh-interval", type=float, default=None, metavar="SECONDS",
        help="move to the hub's newest snapshot automatically, checking this often; 0 (a config file's off) or by "
        "default: only on `cachefs refresh`",
    )
    mount.add_argument(
        "--manifest-wait", type=float, default=60.0, metavar="SECONDS",
        help="with a snapshot in the cache dir, mount on it if the hub's new manifest takes longer than this, "
        "and load that in the background (default: 60)",
    )
    mount.add_argument(
        "--token-file", type=Path, metavar="FILE",
        help=f"bearer token for the hub, in a file of mode 0600 (or set ${TOKEN_ENV}); never on the command line",
    )
    mount.add_argument(
        "--tier", action="append", metavar="URL",
        help="a node of the region's nginx tier (deploy/nginx/regional-cache.conf), once per node, in the same order "
        "on every spoke: file data comes from the node owning each slice, the next if it fails, last the hub "
        "(docs/regional-tier.md; default: straight from the hub)",
    )
    mount.add_argument(
        "--tier-slice", default="1M",
        help="the tier nodes' nginx `slice` size: each slice is asked of one node (default: 1M)",
    )
    mount.add_argument("--ca-file", type=Path, metavar="FILE", help="CA bundle to verify an https hub with (default: system CAs)")
    mount.add_argument("--tls-cert", type=Path, metavar="FILE", help="client certificate for hubs that require mutual TLS")
    mount.add_argument("--tls-key", type=Path, metavar="FILE", help="private key of --tls-cert")
    mount.add_argument(
        "--metrics-listen", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)"
    )
    mount.add_argument(
        "--mount-timeout", type=float, default=300.0, metavar="SECONDS", help="give up mounting after this long (default: 300)"
    )
    mount.add_argument(
        "--allow-other", action=argparse.BooleanOptionalAction, default=False,
        help="let other local users read the mount (file modes from the hub still apply); default: only you",
    )
    mount.add_argument("--uid", metavar="USER", help="owner of every file and directory, a name or number (default: yours)")
    mount.add_argument("--gid", metavar="GROUP", help="group of every file and directory, a name or number (default: yours)")
    mount.add_argument("--file-mode", metavar="MODE", help="permission bits of every file, e.g. 0640 (default: the hub's)")
    mount.add_argument("--dir-mode", metavar="MODE", help="permission bits of every directory, e.g. 0750 (default: the hub's)")
    mount.add_argument(
        "--passthrough", action=argparse.BooleanOptionalAction, default=None,
        help="let the kernel read whole, verified cached files straight from the cache (FUSE passthrough: local disk "
        "speed; each file is verified whole first, sealed read-only and re-verified every --reverify-interval). "
        "Default: on where the kernel and pyfuse3 allow it, except with --nfs-export; off, or where they do not, "
        "the daemon serves and checks every read",
    )
    mount.add_argument(
        "--reverify-interval", type=float, default=86400.0, metavar="SECONDS",
        help="re-hash each cached file the kernel reads directly this long after its last verification; one that "
        "changed on disk goes back to the daemon and its bad blocks are fetched again (default: 86400)",
    )
    mount.add_argument(
        "--reverify-rate", default="64M", metavar="BYTES",
        help="read at most this many bytes per second when re-verifying, e.g. 64M (default: 64M)",
    )
    mount.add_argument(
        "--nfs-export", action=argparse.BooleanOptionalAction, default=False,
        help="for a mount served over NFS (`cachefs export`): a file changed by a refresh gets new file handles, its "
        "old ones answer ESTALE (so the daemon serves every read: no passthrough); default: files open before a "
        "refresh keep reading their version",
    )
    mount.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground and log to stderr")
    mount.add_argument("--debug", action=argparse.BooleanOptionalAction, default=False, help="verbose logging")
    mount.add_argument(
        "--config", type=Path, metavar="FILE",
        help="TOML file of mount options (keys as the long options: cache_dir, cache_size, ...); flags override it",
    )
    mount.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

    unmount = commands.add_parser("unmount", aliases=["umount"], help="unmount and stop the daemon")
    unmount.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    unmount.add_argument(
        "--timeout", type=float, default=30.0, metavar="SECONDS", help="wait this long for the daemon to exit (default: 30)"
    )

    bench = commands.add_parser(
        "bench", help="measure read workloads on any directory (run `cachefs bench --help`)", add_help=False
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)

    cli_admin.add_parsers(commands)
    for command_parser in (parser, *commands.choices.values()):
        command_parser.allow_abbrev = False  # --conf must not be taken for --config, which is read apart
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser: argparse would take `bench --help` for ours
        from ..bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(with_config_file(argv, parser, "mount"))
    except ConfigFileError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "mount":
            return _mount(args, argv)
        if args.command in ("unmount", "umount"):
            return _unmount(args)
        return cli_admin.run(args)
    except CachefsError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, InvalidOptionValue) else 1
    except KeyboardInterrupt:
        print("cachefs: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `cachefs stats | head`: the reader is gone, and so is the rest of the output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no traceback at exit's flush either
        return 1


# -- mount ----------------------------------------------------------------------


def _env_token() -> str | None:
    """The token in $CACHEFS_HUB_TOKEN (a secret mounted as a variable often ends in a newline)."""
    token = os.environ.get(TOKEN_ENV)
    return checked_token(token, f"${TOKEN_ENV}") if token else None


# The longest duration an option takes (~115 days): beyond it, time_t and
# select() overflow, and no wait that long is meant.
MAX_SECONDS = 10_000_000


def _check_seconds(option: str, value: float | None) -> None:
    """A duration option is a positive number of seconds, at most MAX_SECONDS (None: not given)."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        flag = "--" + option.replace("_", "-")
        raise UsageError(f"invalid {flag} {value:g}: a positive number of seconds, at most {MAX_SECONDS:,}")


def _passthrough_mode(asked: bool | None, nfs_export: bool) -> PassthroughMode:
    """Off for an NFS export: a file open in passthrough mode reads its data file until it is
    closed, so Ganesha's open of a version a refresh replaced could not fail (ESTALE)."""
    if nfs_export:
        if asked:
            raise UsageError("--passthrough cannot be used with --nfs-export: the NFS handles of a file a refresh "
                             "changed must fail, and the kernel's direct reads cannot be stopped")
        return PassthroughMode.OFF
    return {None: PassthroughMode.AUTO, True: PassthroughMode.ON, False: PassthroughMode.OFF}[asked]


def _config_from_args(args: argparse.Namespace) -> MountConfig:
    if args.max_connections < 1:
        raise UsageError("--max-connections must be at least 1")
    if args.readahead_blocks < 0 or args.prefetch_siblings < 0:
        raise UsageError("--readahead-blocks and --prefetch-siblings must not be negative")
    if args.refresh_interval == 0:  # off, as by default (a flag turning off a config file's)
        args.refresh_interval = None
    for option in ("fetch_timeout", "refresh_interval", "manifest_wait", "mount_timeout", "reverify_interval"):
        _check_seconds(option, getattr(args, option))
    hub_url = parse_hub_url(args.hub_url)
    pool_dir = Path(os.path.abspath(args.cache_dir))
    tenant = validate_tenant(args.tenant) if args.tenant is not None else DEFAULT_TENANT
    cache_size = parse_size(args.cache_size)
    cache_min = parse_size(args.cache_min, zero=True) if args.cache_min is not None else 0  # 0: the default
    cache_max = parse_size(args.cache_max) if args.cache_max is not None else None
    if cache_min > min(cache_size, cache_max or cache_size):
        raise UsageError(f"--cache-min {args.cache_min} is more than --cache-max or --cache-size")
    tier_urls = parse_tier(args.tier, hub_url)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: the client certificate and its key")
    tls_options = {flag: path for flag, path in (("--ca-file", args.ca_file), ("--tls-cert", args.tls_cert),
                                                 ("--tls-key", args.tls_key)) if path is not None}
    for flag, path in tls_options.items():  # a key others may read is refused, as a token file
        read_option_file(path, flag, private=flag == "--tls-key")
    if tls_options and not any(url.tls for url in (hub_url, *tier_urls)):
        # Not silently ignored: whoever gave them expects the connection to be encrypted.
        raise UsageError(f"nothing would use {', '.join(tls_options)}: they are for https:// URLs, and the hub "
                         "URL (and every --tier) is http://")
    return MountConfig(
        hub_url=hub_url,
        mountpoint=Path(os.path.abspath(args.mountpoint)),
        cache_dir=tenant_dir(pool_dir, tenant),
        pool_dir=pool_dir,
        tenant=tenant,
        cache_min_bytes=cache_min,
        cache_max_bytes=cache_max,
        cache_size_bytes=cache_size,
        block_size_bytes=validate_block_size(parse_size(args.block_size)),
        max_connections=args.max_connections,
        readahead_blocks=args.readahead_blocks,
        sibling_prefetch_files=args.prefetch_siblings,
        refresh_interval_s=args.refresh_interval,
        manifest_wait_s=args.manifest_wait,
        tier_urls=tier_urls,
        tier_slice_bytes=validate_tier_slice(parse_size(args.tier_slice)),
        metrics_listen=parse_listen(args.metrics_listen) if args.metrics_listen else None,
        token=read_token(args.token_file) if args.token_file else _env_token(),
        ca_file=args.ca_file,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
        fetch_timeout_s=args.fetch_timeout,
        allow_other=args.allow_other,
        uid=parse_user(args.uid) if args.uid is not None else None,
        gid=parse_group(args.gid) if args.gid is not None else None,
        file_mode=parse_mode(args.file_mode) if args.file_mode is not None else None,
        dir_mode=parse_mode(args.dir_mode) if args.dir_mode is not None else None,
        nfs_export=args.nfs_export,
        passthrough=_passthrough_mode(args.passthrough, args.nfs_export),
        reverify_interval_s=args.reverify_interval,
        reverify_rate_bytes=parse_size(args.reverify_rate),
        foreground=args.foreground,
        debug=args.debug,
    )


def _prepare_cache_dir(path: Path) -> None:
    remote = network_file_system(path)
    if remote is not None:
        raise UsageError(
            f"cache dir {path} is on {remote}, a network file system: put the cache on a local disk "
            "(its index is a memory-mapped database that network file systems do not keep safe)"
        )
    # Only the last component is created: a missing parent is most often a cache disk
    # that is not mounted, and creating it would fill the disk under it instead.
    if not path.parent.is_dir():
        raise UsageError(f"cache dir {path}: {path.parent} does not exist (is the cache disk mounted?)")
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create cache dir {path}: {exc.strerror}") from None
    if not path.is_dir():
        raise UsageError(f"cache dir {path} is not a directory")
    _check_owner(path)
    probe = path / f".write-test.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            frees_space = can_free_space(fd)
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as exc:
        raise UsageError(f"cache dir {path} is not writable: {exc.strerror}") from None
    if not frees_space:
        raise UsageError(
            f"cache dir {path} is on a file system that cannot free part of a file (fallocate punch hole: "
            f"{os.strerror(errno.EOPNOTSUPP)}), so evicted blocks would never give their space back; use a disk or tmpfs"
        )
    _make_private(path)  # after the checks above: a directory that cannot be a cache dir is left as it is


def _prepare_tenant_dir(path: Path) -> None:
    """A tenant's own directory inside the shared cache dir (made 0700; the cache dir itself for the default tenant)."""
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)  # tenants/ (or, for the default tenant, the cache dir's parent)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the tenant's directory {path}: {exc.strerror}") from None


def _warn_if_token_in_clear(config: MountConfig) -> None:
    """One warning at start when the bearer token would cross the network unencrypted.

    A loopback hub URL is warned about too: the spoke cannot tell a hub on this
    host from a forwarder (socat, a sidecar) that carries the token on in clear.
    """
    in_clear = [str(url) for url in (config.hub_url, *config.tier_urls) if not url.tls]
    if config.token and in_clear:
        log.warning(
            "the hub token goes to %s unencrypted: anyone on the network path can read and reuse it, and can "
            "change the data in transit (the block checksums come over the same connection, so they do not "
            "catch that); use https:// URLs", ", ".join(in_clear),
        )


# Names of a cache dir that cachefs used before: one open to others is made
# private only when it is one of these, or empty.
_CACHE_DIR_MARKERS = ("lock", "index.lmdb", LOG_FILE, TENANTS_DIR)


def _check_owner(path: Path) -> None:
    """The cache dir must be the daemon user's own: it holds the dataset's paths and bytes."""
    owner = path.stat().st_uid
    if owner != os.geteuid():
        raise UsageError(
            f"cache dir {path} is owned by uid {owner}, not by this daemon's uid {os.geteuid()}: "
            "its cached data must be private; chown it or use another cache dir"
        )


def _make_private(path: Path) -> None:
    """Only the daemon's user may enter the cache dir: its index names every path and size of
    the dataset, its data files hold the bytes. One open to others (a Kubernetes
    DirectoryOrCreate hostPath is 0755) is made 0700 if it is empty or a cache dir
    already; any other directory is refused, not changed."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & 0o077:
        return
    with os.scandir(path) as entries:
        names = {entry.name for entry in entries} - {"lost+found"}  # the root of a fresh file system
    if names and not names.intersection(_CACHE_DIR_MARKERS):
        raise UsageError(
            f"cache dir {path} is open to other users (mode {mode:04o}) and holds files cachefs did not make: "
            "give cachefs a directory of its own, or chmod 700 this one"
        )
    try:
        os.chmod(path, 0o700)
    except OSError as exc:
        raise UsageError(f"cache dir {path} is open to other users (mode {mode:04o}) and cannot be made 0700: "
                         f"{exc.strerror}") from None
    log.warning("cache dir %s was open to other users (mode %04o): made it 0700", path, mode)


class InvalidOptionValue(UsageError):
    """An option value `cachefs mount` refuses: exit code 2, like argparse's own errors,
    which mount.cachefs reports to mount(8) as incorrect invocation."""


def _mount(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        config = _config_from_args(args)
    except UsageError as exc:
        raise InvalidOptionValue(str(exc)) from None
    if args.ready_fd is None:
        _check_fuse_installed()
        _setup_logging(config.debug, None)
        _warn_if_token_in_clear(config)
        prepare_mountpoint(config.mountpoint)
        _prepare_cache_dir(config.pool_dir or config.cache_dir)
        _prepare_tenant_dir(config.cache_dir)
        if not config.foreground:
            return _start_background(config, argv, args.mount_timeout)
        return _run_foreground(config, notify=lambda _message: None)
    _setup_logging(config.debug, config.cache_dir / LOG_FILE)
    _warn_if_token_in_clear(config)  # in the daemon's log too: its user may never see the terminal's
    ready = os.fdopen(args.ready_fd, "w")

    def notify(message: str) -> None:
        """Tell the parent (mount readiness or a start-up error); it is gone once the mount was up."""
        with contextlib.suppress(OSError, ValueError):
            ready.write(message + "\n")
            ready.flush()

    status = _run_foreground(config, notify)
    with contextlib.suppress(OSError):
        ready.close()
    return status


def _check_fuse_installed() -> None:
    """pyfuse3 is the spoke's own dependency, missing from an install without the `spoke` extra."""
    if importlib.util.find_spec("pyfuse3") is None:
        raise UsageError("pyfuse3 is not installed: install the spoke with `pip install 'cachefs[spoke]'`")


def _run_foreground(config: MountConfig, notify: Any) -> int:
    from ..daemon import describe_error, run_daemon, unwrapped  # pyfuse3 is only needed here

    try:
        return run_daemon(config, notify)
    except Exception as exc:
        message = describe_error(exc)
        if not isinstance(unwrapped(exc), (CachefsError, OSError)):
            log.exception("daemon failed")
        log.error("%s", message)
        notify(f"error: {message}")
        return 1


def _start_background(config: MountConfig, argv: list[str], timeout_s: float) -> int:
    """Start the daemon detached and wait until it reports the mount live (or an error)."""
    read_end, write_end = os.pipe()
    log_path = config.cache_dir / LOG_FILE
    with open(log_path, "ab", opener=lambda name, flags: os.open(name, flags, 0o600)) as log_file:
        os.chmod(log_path, 0o600)  # made by an older cachefs, or under another umask
        child = subprocess.Popen(
            [sys.executable, "-m", "cachefs", argv[0], "--ready-fd", str(write_end), *argv[1:]],  # before any "--"
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    os.close(write_end)
    try:
        message = _wait_for_message(read_end, child, timeout_s)
    finally:
        os.close(read_end)
    if message == "ready":
        print(f"cachefs: {config.hub_url} mounted on {config.mountpoint} (daemon pid {child.pid}, log {log_path})")
        return 0
    if message is None:
        child.terminate()
        raise CachefsError(f"mount did not complete within {timeout_s:g} s; see {log_path}")
    raise CachefsError(message.removeprefix("error: ") if message else f"daemon exited unexpectedly; see {log_path}")


def _wait_for_message(fd: int, child: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """The daemon's first line ("ready" or "error: ..."); "" if it died silently; None on timeout."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            child.wait(timeout=10)
            return data.decode(errors="replace").strip()
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def _setup_logging(debug: bool, log_path: Path | None) -> None:
    level = logging.DEBUG if debug else logging.INFO
    if log_path is None:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        text = "%(asctime)s %(name)s %(levelname)s %(message)s" if debug else "cachefs: %(message)s"
        handler.setFormatter(logging.Formatter(text))
    else:
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


# -- unmount --------------------------------------------------------------------


def _unmount(args: argparse.Namespace) -> int:
    _check_seconds("timeout", args.timeout)
    path = cli_admin.cachefs_mount(args.mountpoint)
    answering = True
    try:
        pid: int | None = cli_admin.read_stats_xattr(path)["pid"]
    except cli_admin.DaemonNotAnswering:
        pid, answering = None, False  # stopped or hung: unmount without it, its pid unknown
    except CachefsError:
        pid = None  # daemon dead: a stale mount
    if pid is None:
        # A lazy unmount: the request that went unanswered (this command's own, still in the
        # kernel's queue) keeps the mount busy; the daemon exits once it runs again.
        lazy_unmount(path)
        print(f"cachefs: removed stale mount {path}" if answering else
              f"cachefs: detached {path}; its daemon did not answer (stopped or hung) and was not waited for")
        return 0
    result = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "fusermount3 failed"
        raise CachefsError(f"cannot unmount {path}: {reason}")
    if not wait_for_pid(pid, args.timeout):
        raise CachefsError(f"unmounted {path}, but daemon pid {pid} did not exit within {args.timeout:g} s")
    print(f"cachefs: unmounted {path}")
    return 0
