"""Operator commands of the CLI: stats, warm, unpin, evict, purge, refresh (over the control socket)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..config import format_size
from ..control import server as control
from ..errors import CachefsError, UsageError
from ..fs.mountpoints import FSTYPE, find_mount, list_mounts
from .export import (
    SQUASH_MODES,
    ExportConfig,
    build_fsid_shim,
    check_exportable,
    ganesha_command,
    ganesha_config,
    ganesha_environment,
    parse_clients,
    parse_protocols,
)

STATS_XATTR = "user.cachefs.stats"
# The attribute is answered by the daemon's event loop in milliseconds; a daemon that is
# stopped or hung never answers, and the read would wait forever (FUSE has no timeout).
STATS_XATTR_TIMEOUT_S = 10.0


class DaemonNotAnswering(CachefsError):
    """The mount's daemon did not answer the stats attribute in time (stopped or hung)."""


def add_parsers(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    warm = commands.add_parser("warm", help="fetch files or directory trees into the cache, with progress")
    warm.add_argument("paths", metavar="PATH", nargs="+", type=Path, help="files or directories inside a cachefs mount")
    warm.add_argument("--pin", action="store_true", help="keep them out of eviction until `cachefs unpin`")
    warm.add_argument("--parallel", type=int, default=8, metavar="N", help="files fetched at once (default: 8)")

    unpin = commands.add_parser("unpin", help="let pinned files be evicted again")
    unpin.add_argument("paths", metavar="PATH", nargs="+", type=Path)

    evict = commands.add_parser("evict", help="drop the cached data of files or directory trees")
    evict.add_argument("paths", metavar="PATH", nargs="+", type=Path)

    purge = commands.add_parser("purge", help="drop every cached block (and pin) of a mount")
    purge.add_argument("--all", action="store_true", required=True, help="required: confirms dropping everything")
    purge.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path, nargs="?", help="needed if several cachefs mounts exist")

    refresh = commands.add_parser("refresh", help="move a mount to the hub's newest snapshot")
    refresh.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)

    export = commands.add_parser(
        "export", help="export a mount read-only over NFSv3/v4 with NFS-Ganesha (print its config, or run it)"
    )
    export.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path, help="a cachefs mount made with --allow-other")
    export.add_argument(
        "--clients", required=True, metavar="LIST", help="who may mount: IP addresses, CIDR networks or '*', comma-separated"
    )
    export.add_argument("--protocols", default="3,4", metavar="LIST", help="NFS versions: 3, 4 or 3,4 (default: 3,4)")
    export.add_argument("--pseudo", default="", metavar="PATH", help="the NFSv4 path (default: the mountpoint's path)")
    export.add_argument("--export-id", type=int, default=1, metavar="N", help="Ganesha's export id (default: 1)")
    export.add_argument("--squash", choices=SQUASH_MODES, default="root_squash", help="client uids mapped to nobody")
    export.add_argument("--nfs-port", type=int, default=2049, metavar="PORT", help="(default: 2049)")
    export.add_argument("--mount-port", type=int, default=20048, metavar="PORT", help="NFSv3 mountd (default: 20048)")
    export.add_argument("--bind", metavar="ADDRESS", help="listen on this address only (default: all)")
    export.add_argument(
        "--grace-period", type=int, default=40, metavar="SECONDS",
        help="after a restart, NFSv4 clients reclaim their opens for this long (0: none; default: 40)",
    )
    export.add_argument(
        "--state-dir", type=Path, default=Path("/var/lib/cachefs/nfs"), metavar="DIR",
        help="NFSv4 client records and the written config (default: /var/lib/cachefs/nfs)",
    )
    export.add_argument("--run", action="store_true", help="write the config into --state-dir and run Ganesha in the foreground")
    export.add_argument(
        "--no-stable-handles", action="store_true",
        help="with --run: do not build and preload the shim that keeps NFS handles valid across a remount of the "
        "spoke (it needs a C compiler)",
    )

    stats = commands.add_parser("stats", help="show cache statistics of a mount")
    stats.add_argument("mountpoint", metavar="MOUNTPOINT", type=Path)
    stats.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    command = {
        "warm": _warm, "unpin": _unpin, "evict": _evict, "purge": _purge, "stats": _stats, "refresh": _refresh,
        "export": _export,
    }[args.command]
    return command(args)


# -- finding the daemon -------------------------------------------------------------


def cachefs_mount(path: Path) -> Path:
    """`path` itself, checked to be a cachefs mountpoint."""
    path = Path(os.path.abspath(path))
    mount = find_mount(path)
    if mount is None:
        raise UsageError(f"{path} is not mounted")
    if mount.fstype != FSTYPE:
        raise UsageError(f"{path} is not a cachefs mount ({mount.fstype})")
    return path


def read_stats_xattr(mountpoint: Path, timeout_s: float = STATS_XATTR_TIMEOUT_S) -> dict[str, Any]:
    """The daemon's stats attribute, read in a thread: a stopped or hung daemon never answers,
    and a FUSE request cannot be given up on, so the command gives up on the thread instead."""
    answer: dict[str, Any] = {}

    def read() -> None:
        try:
            answer["value"] = os.getxattr(mountpoint, STATS_XATTR)
        except OSError as exc:
            answer["error"] = exc

    reader = threading.Thread(target=read, name="stats-xattr", daemon=True)  # daemon: exit does not wait for it
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():
        raise DaemonNotAnswering(f"the daemon of {mountpoint} did not answer within {timeout_s:g} s (stopped or hung)")
    if "error" in answer:
        raise CachefsError(f"cannot reach the daemon of {mountpoint}: {answer['error'].strerror}")
    stats: dict[str, Any] = json.loads(answer["value"])
    return stats


def _locate(path: Path) -> tuple[Path, str]:
    """The cachefs mountpoint holding `path`, and `path` relative to it."""
    absolute = Path(os.path.abspath(path))
    for candidate in [absolute, *absolute.parents]:
        mount = find_mount(candidate)
        if mount is not None:
            if mount.fstype != FSTYPE:
                break
            return candidate, str(absolute.relative_to(candidate))
    raise UsageError(f"{path} is not inside a cachefs mount")


def _socket(mountpoint: Path) -> Path:
    return Path(read_stats_xattr(mountpoint)["cache_dir"]) / control.SOCKET_NAME


def _call_for_paths(command: str, paths: list[Path], **extra: Any) -> tuple[Path, dict[str, Any]]:
    located = [_locate(path) for path in paths]
    mountpoints = {mountpoint for mountpoint, _rel in located}
    if len(mountpoints) != 1:
        raise UsageError("all paths must be inside the same cachefs mount")
    mountpoint = mountpoints.pop()
    relative = ["" if rel == "." else rel for _mp, rel in located]
    progress = _ProgressPrinter() if command == "warm" else None
    result = control.call(_socket(mountpoint), {"command": command, "paths": relative, **extra},
                          progress.update if progress else None)
    if progress:
        progress.finish()
    return mountpoint, result


# -- commands ---------------------------------------------------------------------


def _warm(args: argparse.Namespace) -> int:
    _mountpoint, result = _call_for_paths("warm", args.paths, pin=args.pin, parallel=args.parallel)
    print(
        f"cachefs: warmed {result['files_total']} files ({format_size(result['bytes_total'])}): "
        f"{format_size(result['fetched_bytes'])} fetched from {result['hub_url']}, "
        f"{format_size(result['cached_before_bytes'])} already cached"
        + (", pinned" if result["pinned"] else "")
        + f", {result['elapsed_s']:.1f} s"
    )
    if result["failed_files"]:
        print(f"cachefs: error: {result['failed_files']} files could not be fetched completely; "
              "run the command again to resume", file=sys.stderr)
        return 1
    if result["cached_now_bytes"] < result["bytes_total"]:
        print(f"cachefs: warning: the cache holds {format_size(result['cached_now_bytes'])} of the "
              f"{format_size(result['bytes_total'])} warmed: they do not fit in it (--cache-size), "
              "or other reads took the room", file=sys.stderr)
    return 0


def _unpin(args: argparse.Namespace) -> int:
    _mountpoint, result = _call_for_paths("unpin", args.paths)
    print(f"cachefs: unpinned {result['unpinned_files']} of {result['files']} files")
    return 0


def _evict(args: argparse.Namespace) -> int:
    _mountpoint, result = _call_for_paths("evict", args.paths)
    print(f"cachefs: evicted {format_size(result['freed_bytes'])} of {result['files']} files")
    return 0


def _purge(args: argparse.Namespace) -> int:
    if args.mountpoint is not None:
        mountpoint = cachefs_mount(args.mountpoint)
    else:
        mounts = [Path(m.mountpoint) for m in list_mounts() if m.fstype == FSTYPE]
        if len(mounts) != 1:
            raise UsageError("name the MOUNTPOINT to purge" if mounts else "no cachefs mount found")
        mountpoint = mounts[0]
    result = control.call(_socket(mountpoint), {"command": "purge", "all": True})
    print(f"cachefs: purged {result['purged_blocks']} cached blocks of {mountpoint}")
    return 0


def _refresh(args: argparse.Namespace) -> int:
    mountpoint = cachefs_mount(args.mountpoint)
    result = control.call(_socket(mountpoint), {"command": "refresh"})
    if not result["changed"]:
        print(f"cachefs: {mountpoint} already shows the hub's newest snapshot ({result['generation']})")
    else:
        print(f"cachefs: {mountpoint} now shows generation {result['generation']} (was {result['previous_generation']}): "
              f"{result['changed_entries']} entries changed, {result['removed_entries']} removed, "
              f"{result['dropped_blocks']} stale cached blocks dropped")
    return 0


def _cached_since(unix_s: int | None, blocks: int) -> str:
    """When the oldest cached block was cached, at the earliest, and how long ago that is."""
    if not blocks:
        return "none cached"
    if unix_s is None:
        return "unknown (cached by an older cachefs)"
    ago_s = max(0, int(time.time()) - unix_s)
    days, rest = divmod(ago_s, 86400)
    ago = f"{days} d {rest // 3600} h" if days else f"{rest // 3600} h {rest % 3600 // 60} min"
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(unix_s))} or later ({ago} ago at most)"


def _stats(args: argparse.Namespace) -> int:
    mountpoint = cachefs_mount(args.mountpoint)
    stats = control.call(_socket(mountpoint), {"command": "stats", "detailed": True}, timeout_s=60)
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    looked_up = stats["block_hits"] + stats["block_misses"]
    hit_ratio = f"{100 * stats['block_hits'] / looked_up:.1f} %" if looked_up else "n/a"
    rows = [
        ("mountpoint", stats["mountpoint"]),
        ("hub", stats["hub_url"]),
        ("generation", stats["generation"]),
        ("cache dir", stats["cache_dir"]),
        ("cached", f"{format_size(stats['cached_bytes'])} in {stats['cached_blocks']} blocks "
                   f"(limit {format_size(stats['cache_capacity_bytes'])}, "
                   f"{100 * stats['cached_bytes'] / stats['cache_capacity_bytes']:.1f} % used)"),
        ("pinned", format_size(stats["pinned_bytes"])),
        ("oldest block cached", _cached_since(stats.get("oldest_cached_unix"), stats["cached_blocks"])),
        ("reads", f"{stats['reads']} ({format_size(stats['read_bytes'])})"),
        ("block hits", str(stats["block_hits"])),
        ("block misses", str(stats["block_misses"])),
        ("reads from cache disk", f"{stats['disk_reads']} ({stats['disk_reads_inline']} small, without a thread)"),
        ("hit ratio", hit_ratio),
        ("passthrough opens", f"{stats['passthrough_opens']} (read by the kernel from the cache; "
                              f"{stats['verified_files']} files verified for it)"),
        ("re-verified files", f"{stats['reverified_files']} ({stats['reverify_failures']} had changed on disk)"),
        ("fetched from hub", f"{format_size(stats['fetched_bytes'])} in {stats['fetches']} requests"),
        ("read-ahead fetches", str(stats["readahead_fetches"])),
        ("fetch retries", str(stats["fetch_retries"])),
        ("hub errors", ", ".join(f"{kind} {count}" for kind, count in sorted(stats.get("hub_errors", {}).items())) or "0"),
        ("failed reads", str(stats["fetch_failures"])),
        ("corrupt blocks", str(stats["corrupt_blocks"])),
        ("evicted blocks", str(stats["evicted_blocks"])),
        ("not admitted", str(stats["rejected_blocks"])),
    ]
    process = stats.get("process")
    if process:
        loop = f" ({process['loop_cpu_s']:.1f} on the event loop)" if process.get("loop_cpu_s") is not None else ""
        rows.append(("daemon", f"{process['cpu_s']:.1f} CPU-s{loop}, peak RSS "
                               f"{format_size(process['peak_rss_kib'] * 1024)}"))
    if stats.get("tier_requests"):  # mounted with --tier
        answered, failed = stats["tier_requests"], stats["tier_failovers"]
        rows.append(("tier requests", ", ".join(f"{node} {count}" for node, count in answered.items())))
        rows.append(("tier failovers", ", ".join(f"{node} {count}" for node, count in failed.items())))
    for name, used in sorted(stats.get("usage_by_top_level_bytes", {}).items()):
        rows.append((f"  {name}/", format_size(used)))
    training = stats.get("training")
    if training is not None:
        rows.extend(_training_rows(stats, training))
    tenants: dict[str, Any] = stats.get("tenants") or {"name": "default", "tenants": []}
    shared = tenants["name"] != "default" or len(tenants["tenants"]) > 1
    if shared:
        rows.append(("tenant", f"{tenants['name']}: allowed {format_size(tenants['allowance_bytes'])} "
                               f"of the shared {format_size(tenants['pool_bytes'])}"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if shared:
        print()
        _print_tenants(tenants["tenants"])
    if training is not None and training["epochs"]:
        print()
        _print_epochs(training["epochs"])
    return 0


def _print_tenants(tenants: list[dict[str, Any]]) -> None:
    """Every tenant of the cache dir, as each published itself (counters since its mount)."""
    print(f"{'tenant':<16} {'mounted':>7} {'used':>10} {'min':>10} {'max':>10} {'allowed':>10} "
          f"{'hits':>9} {'misses':>9} {'hit ratio':>9} {'fetched':>10}")
    for tenant in tenants:
        looked_up = tenant["block_hits"] + tenant["block_misses"]
        ratio = f"{100 * tenant['block_hits'] / looked_up:.1f} %" if looked_up else "n/a"
        print(f"{tenant['name']:<16} {'yes' if tenant['live'] else 'no':>7} {format_size(tenant['used_bytes']):>10} "
              f"{format_size(tenant['min_bytes']):>10} {format_size(tenant['max_bytes']):>10} "
              f"{format_size(tenant['allowance_bytes']):>10} {tenant['block_hits']:>9} {tenant['block_misses']:>9} "
              f"{ratio:>9} {format_size(tenant['fetched_bytes']):>10}")


def _training_rows(stats: dict[str, Any], training: dict[str, Any]) -> list[tuple[str, str]]:
    stalled = stats.get("stalled_blocks", 0)
    stall = f"{stats['stall_seconds']:.1f} s waiting on the network in {stalled} block reads"
    if stalled:
        stall += f", {1000 * stats['stall_seconds'] / stalled:.1f} ms per stalled block"
    warm = training["time_to_warm_s"]
    plans = training["plans"]
    epochs = ", ".join(sorted({str(plan["epoch"]) for plan in plans if plan["epoch"] is not None}))
    rows = [
        ("reader stalls", stall),
        ("time to warm", f"{warm:.1f} s" if warm is not None else "not warm (hit ratio not steadily >= 95 %)"),
        ("plans", f"{len(plans)} active" + (f" (epoch {epochs})" if epochs else "")),
        ("plan prefetch", f"{stats.get('plan_prefetch_blocks', 0)} blocks, "
                          f"{stats.get('plan_prefetch_used_blocks', 0)} used, "
                          f"{stats.get('plan_prefetch_wasted_blocks', 0)} wasted; "
                          f"lookahead {training['lookahead_blocks']} blocks"),
    ]
    for plan in plans:
        state = f"epoch {plan['epoch']}" if plan["epoch"] is not None else "being received"
        rows.append((f"  plan {plan['plan']}", f"{state}: {plan['position']} of {plan['blocks']} "
                                               f"block uses, {plan['prefetched_blocks']} prefetched"))
    return rows


def _print_epochs(epochs: list[dict[str, Any]]) -> None:
    print(f"{'epoch':>6} {'time':>9} {'hit ratio':>9} {'stall':>9} {'fetched':>11} {'read':>11} {'warm after':>10}")
    for epoch in epochs:
        ratio = f"{100 * epoch['hit_ratio']:.1f} %" if epoch["hit_ratio"] is not None else "n/a"
        warm = f"{epoch['time_to_warm_s']:.1f} s" if epoch["time_to_warm_s"] is not None else "-"
        print(f"{epoch['epoch']:>6} {epoch['duration_s']:>7.1f} s {ratio:>9} {epoch['stall_seconds']:>7.1f} s "
              f"{format_size(epoch['fetched_bytes']):>11} {format_size(epoch['read_bytes']):>11} {warm:>10}"
              + ("  (current)" if epoch["current"] else ""))


class _ProgressPrinter:
    """A progress bar on a terminal, plain lines every few seconds otherwise."""

    PLAIN_INTERVAL_S = 5.0

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._last_plain = 0.0

    def update(self, report: dict[str, Any]) -> None:
        total = max(1, report["bytes_total"])
        fraction = report["bytes_done"] / total
        eta = f"{report['eta_s']:.0f} s" if report.get("eta_s") is not None else "?"
        text = (f"{100 * fraction:5.1f} %  {format_size(report['bytes_done'])} / {format_size(report['bytes_total'])}"
                f"  {report['files_done']}/{report['files_total']} files"
                f"  {format_size(report['rate_bytes_per_s'])}/s  ETA {eta}")
        if self._tty:
            filled = int(30 * fraction)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}   ")
            sys.stderr.flush()
        elif time.monotonic() - self._last_plain >= self.PLAIN_INTERVAL_S:
            self._last_plain = time.monotonic()
            print(f"cachefs: warm {text}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self._tty:
            sys.stderr.write("\n")


# -- export -----------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    mountpoint = Path(os.path.abspath(args.mountpoint))
    check_exportable(mountpoint)
    for option, port in (("--nfs-port", args.nfs_port), ("--mount-port", args.mount_port)):
        if not 0 < port < 65536:
            raise UsageError(f"invalid {option} {port}: 1 to 65535")
    if args.bind is not None:
        try:
            if ipaddress.ip_address(args.bind).version != 4:  # Ganesha 4.3 does not take an IPv6 Bind_Addr
                raise ValueError(args.bind)
        except ValueError:
            raise UsageError(f"invalid --bind {args.bind!r}: an IPv4 address") from None
    if not 0 <= args.grace_period <= 3600 or not 0 < args.export_id < 65536:
        raise UsageError("--grace-period is 0 to 3600 seconds, --export-id 1 to 65535")
    config = ExportConfig(
        mountpoint=mountpoint,
        clients=parse_clients(args.clients),
        protocols=parse_protocols(args.protocols),
        pseudo=args.pseudo,
        export_id=args.export_id,
        squash=args.squash,
        nfs_port=args.nfs_port,
        mount_port=args.mount_port,
        bind_addr=args.bind,
        grace_period_s=args.grace_period,
        state_dir=Path(os.path.abspath(args.state_dir)),
    )
    text = ganesha_config(config)
    if not args.run:
        sys.stdout.write(text)
        return 0
    try:
        config.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        config_file = config.state_dir / "ganesha.conf"
        config_file.write_text(text)
    except OSError as exc:
        raise UsageError(f"cannot write the config into {config.state_dir}: {exc.strerror}") from None
    command = ganesha_command(config_file, config.state_dir / "ganesha.pid")
    shim = None if args.no_stable_handles else build_fsid_shim(config.state_dir)
    print(f"cachefs: exporting {mountpoint} read-only over NFSv{'/v'.join(map(str, config.protocols))}", file=sys.stderr)
    os.execve(command[0], command, ganesha_environment(mountpoint, shim))
