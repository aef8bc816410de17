"""The spoke daemon: wiring, manifest sync, pyfuse3 init/main/close, signals.

`run_daemon` runs in the foreground process (`--foreground`) or in the
background child that `cachefs mount` starts; it reports readiness or a
one-line error through `notify` once the mount is live or has failed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import lmdb
import pyfuse3
import trio

from . import __version__
from .buffers import BlockBuffers
from .cache import BlockCache
from .cache.share import REFRESH_INTERVAL_S, TenantShare
from .cache.tenants import DEFAULT_TENANT, Ledger
from .config import MountConfig, Ownership, memory_budget, prefetch_connections
from .control.admin import Admin
from .control.server import SOCKET_NAME, ControlServer
from .db import IndexDb, NamespaceDb, get_meta, open_cache_databases, put_meta
from .errors import CacheDirInUse, CachefsError, UsageError
from .fetch.fetcher import Fetcher
from .fetch.hub_client import ClientOptions, HubClient
from .fetch.tier_client import TierClient
from .fs.failed_reads import FailedReads
from .fs.mountpoints import find_mount
from .fs.operations import CachefsOperations, drop_kernel_pages
from .fs.passthrough import Passthrough
from .fs.reverify import Reverifier
from .metrics import Stats, cache_gauges, process_usage, serve_metrics, training_gauges
from .namespace.snapshots import Snapshots
from .namespace.tree import Namespace
from .prefetch.readahead import ReadAhead
from .read.blocks import BlockSource
from .read.claims import ReadAheadClaims
from .read.handles import OpenFiles
from .read.held import HeldBlocks
from .read.reader import Reader
from .sd_notify import sd_notify
from .training.advice import ActivePlans
from .training.planner import Planner

log = logging.getLogger(__name__)

Notify = Callable[[str], None]
POLICY_SAVE_INTERVAL_S = 60.0
# Seconds without a fetch or a read after which the heap's free pages go back to the system.
IDLE_TRIM_S = 1.0
# Block buffer slots free this long give their pages back even while the daemon is busy: the heap
# (small files after shards) cannot use the pool's spare memory (docs/performance.md).
SPARE_SLOT_S = 0.25
# How often read-ahead blocks nobody read are looked at for their age limit (30 s by default).
READ_AHEAD_EXPIRY_S = 5.0
# Data files swept per worker-thread call after a crash: each holds the cache lock for one file,
# and an unmount waits for at most one batch.
SWEEP_BATCH_FILES = 256
# A lock held by another tenant's liveness probe is free again within microseconds,
# one held while another tenant reclaims this one's blocks within a second or so;
# one held by a daemon is not within these 3 s.
LOCK_ATTEMPTS = 120
LOCK_RETRY_S = 0.025
FUSECTL_DIR = Path("/sys/fs/fuse/connections")


class CacheDirLock:
    """An exclusive flock on <cache_dir>/lock, holding the daemon's pid (a tenant's: its own directory's)."""

    def __init__(self, cache_dir: Path, tenant: str = DEFAULT_TENANT, pool_dir: Path | None = None) -> None:
        self.path = cache_dir / "lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        for attempt in range(LOCK_ATTEMPTS):
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt + 1 < LOCK_ATTEMPTS:  # another tenant's liveness probe holds it for a moment
                    time.sleep(LOCK_RETRY_S)
                    continue
                owner = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(self._fd)
                raise CacheDirInUse(
                    f"cache dir {pool_dir or cache_dir} is in use by another cachefs daemon (pid {owner}) as tenant "
                    f"{tenant!r}: give each mount sharing it its own --tenant"
                ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        os.close(self._fd)


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_malloc() -> None:
    """Keep 1 MiB block buffers on the heap instead of fresh mmaps, in one arena.

    By default glibc serves each large allocation with mmap and returns it on
    free, so every block buffer would cost 256 page faults per MiB. Every
    thread allocates from the main arena, because the worker threads' own
    arenas each kept free block buffers; and free memory at the top of the
    heap goes back to the system above 4 MiB. docs/performance.md has what
    each of the three saves.
    """
    libc = _glibc()
    if libc is None:
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    libc.mallopt(m_mmap_threshold, 64 * 1024 * 1024)
    libc.mallopt(m_trim_threshold, 4 * 1024 * 1024)
    libc.mallopt(m_arena_max, 1)


def run_daemon(config: MountConfig, notify: Notify) -> int:
    """Mount and serve until unmounted or signalled. Returns the exit status."""
    tune_malloc()
    os.umask(0o077)  # every file the daemon and its children create in the cache dir is theirs alone
    lock = CacheDirLock(config.cache_dir, config.tenant, config.pool_dir)
    try:
        stats = Stats()
        share = _tenant_share(config, stats)
        namespace_db, index_db = _open_databases(config)
        try:
            _check_block_size(index_db, config)
            trio.run(_serve, config, namespace_db, index_db, notify, stats, share)
        finally:
            namespace_db.close()
            index_db.close()
    finally:
        lock.release()
    return 0


def _hub_client(config: MountConfig, stats: Stats, buffers: BlockBuffers) -> HubClient:
    """The hub, or with --tier the region's nodes in front of it."""
    options = ClientOptions(
        max_connections=config.max_connections,
        connect_timeout_s=config.connect_timeout_s,
        read_timeout_s=config.read_timeout_s,
        token=config.token,
        ssl_context=_ssl_context(config),
        buffers=buffers,
    )
    if not config.tier_urls:
        return HubClient(config.hub_url, **options)
    log.info("file data through the regional tier (%s), each slice of %d bytes from the node that owns it",
             ", ".join(map(str, config.tier_urls)), config.tier_slice_bytes)
    return TierClient(config.hub_url, config.tier_urls, slice_bytes=config.tier_slice_bytes, stats=stats, **options)


def _open_databases(config: MountConfig) -> tuple[NamespaceDb, IndexDb]:
    try:
        return open_cache_databases(config.cache_dir)
    except lmdb.Error as exc:
        raise CachefsError(f"cannot open the LMDB databases in cache dir {config.cache_dir}: {exc}") from None


def _check_block_size(db: IndexDb, config: MountConfig) -> None:
    stored = get_meta(db, "block_size")
    if stored is None:
        put_meta(db, "block_size", str(config.block_size_bytes))
    elif int(stored) != config.block_size_bytes:
        raise UsageError(
            f"cache dir {config.cache_dir} holds blocks of {stored} bytes; "
            f"mount with --block-size {stored} or use another cache dir"
        )


async def _serve(
    config: MountConfig, namespace_db: NamespaceDb, index_db: IndexDb, notify: Notify, stats: Stats, share: TenantShare
) -> None:
    budget = memory_budget(config)
    over = budget.over_target()
    if over is not None:
        log.warning("%s", over)
    buffers = BlockBuffers(config.block_size_bytes, budget.buffer_pool_bytes)
    client = _hub_client(config, stats, buffers)
    namespace = Namespace(namespace_db)
    handles = OpenFiles()
    snapshots = Snapshots(config, client, namespace_db, namespace, handles.versions)
    behind = await snapshots.load_at_mount()
    held = HeldBlocks(budget)
    claims = ReadAheadClaims()
    plans = ActivePlans(held)
    cache = BlockCache(
        index_db, config.cache_dir, config.cache_size_bytes, config.block_size_bytes, stats, advisor=plans, share=share,
        buffers=buffers,
    )
    mounted = False
    try:  # from here on the cache is closed however the mount ends, so the next one needs no sweep
        # Its bytes, published for the cache dir's other tenants.
        await trio.to_thread.run_sync(share.refresh, cache.used_bytes, cache.pinned_bytes(), cache.pressure)
        fetcher = Fetcher(
            client,
            cache,
            held,
            claims,
            stats,
            budget=budget,
            fetch_timeout_s=config.fetch_timeout_s,
            prefetch_connections=prefetch_connections(config),
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run_writer)
            planner = Planner(namespace, cache, fetcher, held, plans, stats, budget=budget, cache_dir=config.cache_dir)
            await nursery.start(planner.run)
            passthrough = Passthrough(cache, plans, stats, mode=config.passthrough)
            readahead = ReadAhead(
                namespace,
                cache,
                fetcher,
                plans,
                stats,
                block_size=config.block_size_bytes,
                readahead_blocks=config.readahead_blocks,
                sibling_prefetch_files=config.sibling_prefetch_files,
                nursery=nursery,
                on_filled=passthrough.filled,
            )
            source = BlockSource(held, cache, fetcher, stats)
            reader = Reader(source, cache.sketch, claims, planner, readahead, stats, block_size=config.block_size_bytes)

            async def refresh() -> dict[str, Any]:
                # Plans resolved against the old snapshot end once the new one is loaded;
                # those that started arriving after it was shown are kept.
                return await snapshots.refresh(
                    cache,
                    operations.tell_kernel,
                    lambda generation: planner.cancel_all("the mount moved to a new snapshot", generation),
                    operations.refreshing,
                )

            sections = {"training": planner.snapshot, "process": process_usage}
            # Every tenant's name, pid and activity: not for everyone who may read the mount.
            tenants = {"tenants": lambda: share.snapshot(cache.used_bytes(), cache.pinned_bytes())}
            admin = Admin(config, namespace, cache, fetcher, stats, refresh=refresh, sections=sections,
                          private_sections=tenants, drop_pages=drop_kernel_pages)
            await nursery.start(passthrough.run_verifier)
            if passthrough.enabled:
                reverifier = Reverifier(cache, passthrough, fetcher, stats, interval_s=config.reverify_interval_s,
                                        rate_bytes=config.reverify_rate_bytes)
                await nursery.start(reverifier.run)
            operations = CachefsOperations(
                namespace,
                reader,
                handles,
                passthrough,
                stats,
                FailedReads(lambda: client.answers),
                ownership=Ownership(
                    uid=os.getuid() if config.uid is None else config.uid,
                    gid=os.getgid() if config.gid is None else config.gid,
                    file_mode=config.file_mode,
                    dir_mode=config.dir_mode,
                ),
                attr_timeout_s=config.attr_timeout_s,
                version_generations=config.nfs_export,
                stats_json=lambda: {"pid": os.getpid(), **admin.snapshot()},
            )
            control = ControlServer(admin.handlers(), {"plan": planner.handle_plan})
            await nursery.start(control.serve, config.cache_dir / SOCKET_NAME)
            if config.metrics_listen is not None:
                _serve_metrics(config, stats, cache, fetcher, held, buffers, planner, share)
            _init_fuse(operations, config)
            mounted = True
            nursery.start_soon(_terminate_on_signal)
            nursery.start_soon(_save_policy_periodically, cache)
            nursery.start_soon(trim_when_idle, stats, lambda: trio.to_thread.run_sync(_trim, buffers))
            nursery.start_soon(_trim_spare_slots, buffers)
            nursery.start_soon(expire_unread_read_ahead, held)
            nursery.start_soon(_keep_to_share, cache, share)
            if config.refresh_interval_s:
                nursery.start_soon(snapshots.poll, config.refresh_interval_s, refresh)  # cancels plans too
            nursery.start_soon(snapshots.drop_stale_blocks, cache)
            if cache.sweep_due:
                nursery.start_soon(_sweep_after_crash, cache)
            if behind:  # the hub's new manifest did not come in time for the mount
                nursery.start_soon(_refresh_once_mounted, refresh)
            nursery.start_soon(_serve_fuse, nursery.cancel_scope)
            await _tune_kernel(config, operations)
            _start_passthrough(operations, passthrough)
            notify("ready")
            sd_notify("READY=1")
            log.info("cachefs %s: %s mounted on %s", __version__, config.hub_url, config.mountpoint)
    finally:
        sd_notify("STOPPING=1")
        if mounted:
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", config.mountpoint)
        cache.save_policy()
        share.note_used(cache.used_bytes(), cache.pinned_bytes())
        await client.aclose()
        cache.close()  # after the cache writer's last batch, which its thread may still be writing


async def _sweep_after_crash(cache: BlockCache) -> None:
    """Free the disk space a crash of an earlier mount left outside the index, SWEEP_BATCH_FILES
    at a time (an unmount ends it between batches; the next mount sweeps again), one line when done."""
    started = time.monotonic()
    punched = removed = 0
    try:
        for directory in await trio.to_thread.run_sync(cache.store.data_dirs):
            files = await trio.to_thread.run_sync(cache.store.data_files, directory)
            for first in range(0, len(files), SWEEP_BATCH_FILES):
                freed = await trio.to_thread.run_sync(cache.sweep_files, files[first : first + SWEEP_BATCH_FILES])
                punched, removed = punched + freed[0], removed + freed[1]
        await trio.to_thread.run_sync(cache.swept)
    except (OSError, lmdb.Error) as exc:
        log.warning("cannot sweep the cache after a crash (%s); the next mount tries again", exc)
        return
    log.info("a mount of this cache did not end cleanly: %d unindexed blocks and %d data files without an "
             "entry freed in %.1f s", punched, removed, time.monotonic() - started)


async def _refresh_once_mounted(refresh: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Move to the hub's new generation in the background (the mount serves the stored one meanwhile)."""
    try:
        result = await refresh()
    except (CachefsError, OSError, lmdb.Error) as exc:  # the hub, or the cache dir: the mount carries on
        log.warning("cannot load the hub's new manifest: %s; still on the stored snapshot", exc)
        return
    log.info("now on the hub's generation %s", result.get("generation"))


def _init_fuse(operations: CachefsOperations, config: MountConfig) -> None:
    options = set(pyfuse3.default_options)  # default_permissions: enforce the hub's modes
    # findmnt and df show the hub as the source; a comma would end the option.
    options |= {f"fsname={str(config.hub_url).replace(',', '%2C')}", "subtype=cachefs", "ro"}
    if config.allow_other:
        options.add("allow_other")
    if config.debug:
        options.add("debug")
    try:
        pyfuse3.init(operations, str(config.mountpoint), options)
    except RuntimeError as exc:
        raise UsageError(f"cannot mount {config.mountpoint}: {exc}") from None


async def _serve_fuse(scope: trio.CancelScope) -> None:
    """Answer FUSE requests until unmounted or terminated, then stop everything else."""
    await pyfuse3.main()
    scope.cancel()


def _ssl_context(config: MountConfig) -> ssl.SSLContext | None:
    """Verification of the hub's certificate (system CAs or --ca-file), client cert for mTLS."""
    if not any(url.tls for url in (config.hub_url, *config.tier_urls)):
        return None
    try:
        context = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if config.client_cert is not None:
            context.load_cert_chain(str(config.client_cert), str(config.client_key) if config.client_key else None)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot set up TLS: {exc}") from None
    return context


def _serve_metrics(
    config: MountConfig, stats: Stats, cache: BlockCache, fetcher: Fetcher, held: HeldBlocks, buffers: BlockBuffers,
    planner: Planner, share: TenantShare,
) -> None:
    assert config.metrics_listen is not None
    try:
        serve_metrics(config.metrics_listen, stats, lambda: {
            **cache_gauges(
                used_bytes=cache.used_bytes(), capacity_bytes=cache.capacity_bytes, pinned_bytes=cache.pinned_bytes(),
                blocks=cache.block_count(), fetches_in_flight=fetcher.requests_in_flight,
                write_backlog=fetcher.write_backlog(), block_buffers=(buffers.in_use_bytes, buffers.resident_bytes),
            ),
            **training_gauges(planner.snapshot(judge=False)),
        }, tenants=lambda: share.snapshot(cache.used_bytes(), cache.pinned_bytes())["tenants"],
            held=held.bytes_by_owner)
    except OSError as exc:
        host, port = config.metrics_listen
        raise UsageError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    log.info("metrics on http://%s:%d/metrics", *config.metrics_listen)


def _tenant_share(config: MountConfig, stats: Stats) -> TenantShare:
    """This mount's share of its cache dir, checked against the tenants mounted on it now."""
    pool_dir = config.pool_dir or config.cache_dir
    share = TenantShare(
        Ledger(pool_dir), config.cache_dir, config.tenant, pool_bytes=config.cache_size_bytes,
        min_bytes=config.cache_min_bytes,
        max_bytes=min(config.cache_max_bytes or config.cache_size_bytes, config.cache_size_bytes),
        block_size=config.block_size_bytes, stats=stats,
    )
    share.check_mount()
    return share


async def _keep_to_share(cache: BlockCache, share: TenantShare) -> None:
    """Recompute this tenant's allowance of the cache dir, publish its use, and give back what it holds beyond."""
    while True:
        try:
            allowance = await trio.to_thread.run_sync(share.refresh, cache.used_bytes, cache.pinned_bytes(), cache.pressure)
            if cache.used_bytes() > allowance:
                await trio.to_thread.run_sync(cache.trim, allowance)
        except (OSError, lmdb.Error) as exc:  # the cache dir's disk: reads go on, the next round tries again
            log.warning("cannot keep this tenant to its share of the cache dir: %s", exc)
        await trio.sleep(REFRESH_INTERVAL_S)


async def _save_policy_periodically(cache: BlockCache) -> None:
    """Policy state survives a crash too, give or take a minute of accesses."""
    while True:
        await trio.sleep(POLICY_SAVE_INTERVAL_S)
        await trio.to_thread.run_sync(cache.save_policy)


def _trim(buffers: BlockBuffers) -> None:
    """Free pages of the heap and of the block buffer pool back to the system (a worker thread's job: it walks the heap)."""
    buffers.trim()
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


async def trim_when_idle(stats: Stats, trim: Callable[[], Awaitable[object]]) -> None:
    """Give the heap's free pages back to the system (`await trim()`) once the daemon
    has fetched and served nothing for IDLE_TRIM_S, once per idle stretch:
    glibc returns only the top of the heap by itself, so after a burst of block
    buffers an idle daemon stayed at its peak. Never while busy: pages given back
    then would be faulted in again at once."""
    last: tuple[int, int] | None = None
    trimmed = True
    while True:
        await trio.sleep(IDLE_TRIM_S)
        moved = (stats.fetched_bytes, stats.read_bytes)
        if moved != last:
            last, trimmed = moved, False
        elif not trimmed:
            await trim()
            trimmed = True


async def _trim_spare_slots(buffers: BlockBuffers) -> None:
    """Every SPARE_SLOT_S, the pages of block buffer slots free that long back to the system (a madvise each)."""
    while True:
        await trio.sleep(SPARE_SLOT_S)
        buffers.trim(free_for_s=SPARE_SLOT_S)


async def expire_unread_read_ahead(held: HeldBlocks) -> None:
    """Every READ_AHEAD_EXPIRY_S, drop read-ahead blocks past their age limit, so that they
    leave memory (and the plan's share) even when no new read-ahead block comes to push them out."""
    while True:
        await trio.sleep(READ_AHEAD_EXPIRY_S)
        held.expire_unread(trio.current_time())


async def _terminate_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:  # what reloads a hub's tokens must not end a mount
                log.warning("received SIGHUP: nothing is reloaded (the token and options are read at mount: "
                            "remount to change them)")
                continue
            log.info("received %s; unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def _start_passthrough(operations: CachefsOperations, passthrough: Passthrough) -> None:
    """Check that the kernel takes backing files (after FUSE_INIT, which _tune_kernel awaits)."""
    if not operations.initialized:
        passthrough.enabled = False
        return
    passthrough.probe()


async def _tune_kernel(config: MountConfig, operations: CachefsOperations) -> None:
    """Raise the kernel's readahead and FUSE background limit for the mount (root only).

    The kernel resets both when it processes the reply to FUSE_INIT, and a
    file keeps the readahead it was opened with, so this runs after INIT and
    before the mount is reported ready. Bounded: at most ~2 s.
    """
    mount = find_mount(config.mountpoint)
    if mount is None:
        return
    for _attempt in range(200):
        await trio.sleep(0.01)
        if operations.initialized:
            break
    else:
        log.warning("no FUSE_INIT in 2 s: kernel readahead and FUSE background limit for %s stay at their defaults",
                    config.mountpoint)
        return
    # sysfs and fusectl: instant, never block on I/O
    _set_kernel_value(Path(f"/sys/class/bdi/{mount.device}/read_ahead_kb"), config.kernel_readahead_kb, "kernel readahead")
    connection = _fuse_connection_dir(mount.device)
    if connection is not None:
        _set_kernel_value(connection / "max_background", config.fuse_max_background, "FUSE background limit")
        _set_kernel_value(connection / "congestion_threshold", config.fuse_max_background * 3 // 4, "FUSE congestion threshold")


def _set_kernel_value(path: Path, wanted: int, what: str) -> None:
    try:
        if path.read_text().strip() != str(wanted):
            path.write_text(str(wanted))
    except OSError as exc:
        log.info("cannot raise %s via %s: %s", what, path, exc)


def _fuse_connection_dir(device: str) -> Path | None:
    """The mount's directory in the FUSE control file system, mounting that (as systemd does at boot) if it is not."""
    major, minor = (int(part) for part in device.split(":"))
    connection = FUSECTL_DIR / str(major << 20 | minor)
    if not connection.is_dir() and FUSECTL_DIR.is_dir() and not any(FUSECTL_DIR.iterdir()):
        try:
            _mount_fusectl()
        except OSError as exc:
            log.info("cannot mount the FUSE control file system on %s: %s", FUSECTL_DIR, exc)
    return connection if connection.is_dir() else None


def _mount_fusectl() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"fusectl", os.fsencode(FUSECTL_DIR), b"fusectl", 0, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def unwrapped(exc: BaseException) -> BaseException:
    """The one error inside the exception groups of nurseries it was raised in."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def describe_error(exc: BaseException) -> str:
    """A one-line message for errors that may reach the user."""
    exc = unwrapped(exc)
    if isinstance(exc, CachefsError):
        return str(exc)
    if isinstance(exc, OSError):
        name = errno.errorcode.get(exc.errno or 0, "error")
        return f"{exc.strerror or name}: {exc.filename}" if exc.filename else f"{exc.strerror or exc}"
    return f"unexpected error: {exc!r}"
