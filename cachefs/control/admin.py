"""Operator commands run inside the daemon: warm (and pin), unpin, evict, purge, refresh, stats.

They arrive over the control socket (server.py). Paths are relative to the
mount's root, as the CLI sends them.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from ..cache import BlockCache, BlockKey
from ..config import COALESCE_BLOCKS, MountConfig
from ..errors import CachefsError
from ..fetch.fetcher import Fetcher
from ..fetch.runs import missing_runs
from ..metrics import Stats
from ..namespace.tree import Inode, Namespace
from .server import Handler, Progress

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5
MAX_PARALLEL = 64


class Admin:
    """The daemon-side implementation of the operator commands."""

    def __init__(
        self,
        config: MountConfig,
        namespace: Namespace,
        cache: BlockCache,
        fetcher: Fetcher,
        stats: Stats,
        *,
        refresh: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        sections: dict[str, Callable[[], dict[str, Any]]] | None = None,
        private_sections: dict[str, Callable[[], dict[str, Any]]] | None = None,
        drop_pages: Callable[[Iterable[int]], object] | None = None,
    ) -> None:
        self._config = config
        # Makes the kernel drop its page cache of these inodes (a worker thread): after an evict
        # or purge a reader gets the bytes from the hub again, not from memory.
        self._drop_pages = drop_pages
        self._namespace = namespace
        self._cache = cache
        self._fetcher = fetcher
        self._stats = stats
        self._refresh = refresh  # moves the mount to the hub's current generation
        # Other components' numbers, each under its name in every stats snapshot (the planner's);
        # the private ones (other tenants' activity) only for the control socket's callers.
        self._sections = dict(sections or {})
        self._private_sections = dict(private_sections or {})

    def handlers(self) -> dict[str, Handler]:
        return {
            "refresh": self.refresh,
            "stats": self.stats,
            "warm": self.warm,
            "unpin": self.unpin,
            "evict": self.evict,
            "purge": self.purge,
        }

    # -- helpers --------------------------------------------------------------------

    async def _drop_kernel_pages(self, inodes: Iterable[int]) -> None:
        if self._drop_pages is not None:
            await trio.to_thread.run_sync(self._drop_pages, inodes)

    async def _files_in_thread(self, paths: Any) -> list[Inode]:
        """`_files` in a worker thread: a directory of a million files takes seconds to walk."""
        return await trio.to_thread.run_sync(self._files, paths)

    def _files(self, paths: Any) -> list[Inode]:
        """Regular files at or below the given paths, each once; unknown paths are an error."""
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise CachefsError("give one or more paths inside the mount")
        files: dict[int, Inode] = {}
        for path in paths:
            inode = self._namespace.resolve(path)
            if inode is None:
                raise CachefsError(f"no such file or directory in the mounted snapshot: {path or '/'}")
            for entry in self._namespace.walk_files(inode):
                files[entry.ino] = entry
        return list(files.values())

    # -- commands -------------------------------------------------------------------

    async def stats(self, request: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """The snapshot; `detailed`: with the usage per top-level directory, counted in a worker
        thread (it goes through the whole block index: on a large cache, seconds)."""
        result = self.snapshot(private=True)
        if request.get("detailed"):
            result["usage_by_top_level_bytes"] = await trio.to_thread.run_sync(self._usage_by_top_level)
            result["oldest_cached_unix"] = await trio.to_thread.run_sync(self._cache.cached_since)
        return result

    def snapshot(self, private: bool = False) -> dict[str, Any]:
        """Counters and cache state; `private`: with the sections only the control socket's
        callers (root, the daemon's owner) may see, not everyone who may use the mount."""
        summary = self._namespace.summary()
        result: dict[str, Any] = {
            "hub_url": str(self._config.hub_url),
            "mountpoint": str(self._config.mountpoint),
            "cache_dir": str(self._config.cache_dir),
            "generation": summary.generation if summary else None,
            "files_bytes": summary.file_bytes if summary else 0,
            "block_size_bytes": self._config.block_size_bytes,
            "cache_capacity_bytes": self._cache.capacity_bytes,
            "cached_bytes": self._cache.used_bytes(),
            "cached_blocks": self._cache.block_count(),
            "pinned_bytes": self._cache.pinned_bytes(),
            **self._stats.as_dict(),
        }
        for name, section in (self._sections | self._private_sections if private else self._sections).items():
            result[name] = section()
        return result

    def _usage_by_top_level(self) -> dict[str, int]:
        """Bytes cached per top-level directory: one lookup per cached file, not a walk of the snapshot."""
        directories: dict[int, str] = {}
        usage: dict[str, int] = collections.Counter()
        file_id, name = b"", ""
        for key, length in self._cache.index.iter_lengths():
            if key.file_id != file_id:  # the blocks of a file come together
                file_id = key.file_id
                name = self._namespace.top_level_name(file_id, directories) or "(not in this snapshot)"
            usage[name] += length
        return dict(usage)

    async def warm(self, request: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Fetch files into the cache, in parallel, reporting progress; optionally pin them."""
        parallel = request.get("parallel", 8)
        if type(parallel) is not int or not 1 <= parallel <= MAX_PARALLEL:
            raise CachefsError(f"--parallel must be between 1 and {MAX_PARALLEL}")
        files = await self._files_in_thread(request.get("paths"))
        if request.get("pin"):
            await trio.to_thread.run_sync(self._cache.pin, {f.file_id: f.size for f in files})
        job = _WarmJob(files, self._fetcher, self._config.block_size_bytes, parallel)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(job.run, nursery.cancel_scope)
            while True:
                await progress(job.report())
                with trio.move_on_after(PROGRESS_INTERVAL_S):
                    await job.finished.wait()
                if job.finished.is_set():
                    break
        result = job.report()
        result["hub_url"] = str(self._config.hub_url)
        result["pinned"] = bool(request.get("pin"))
        result["cached_now_bytes"] = await trio.to_thread.run_sync(self._cached_bytes_of, files)
        log.info("warmed %d files: %d bytes fetched from %s, %d already cached, %d failed",
                 result["files_total"], result["fetched_bytes"], self._config.hub_url,
                 result["cached_before_bytes"], result["failed_files"])
        return result

    def _cached_bytes_of(self, files: list[Inode]) -> int:
        """Bytes of these file versions the cache holds (worker thread: one index walk per file)."""
        return sum(length for inode in files for key, length in self._cache.index.file_blocks(inode.file_id)
                   if key.version == inode.version)

    async def refresh(self, request: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Move the mount to the hub's current generation."""
        if self._refresh is None:
            raise CachefsError("refresh is not available")
        try:
            return await self._refresh()
        except CachefsError as exc:  # the hub, or no room for its manifest
            raise CachefsError(f"cannot refresh: {exc}") from None
        except trio.TooSlowError:
            raise CachefsError("cannot refresh: the hub did not answer in time") from None

    async def unpin(self, request: dict[str, Any], progress: Progress) -> dict[str, Any]:
        files = await self._files_in_thread(request.get("paths"))
        unpinned = await trio.to_thread.run_sync(self._cache.unpin, [f.file_id for f in files])
        return {"unpinned_files": unpinned, "files": len(files)}

    async def evict(self, request: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Drop the cached blocks (and pins) of files; they are fetched again when read."""
        files = await self._files_in_thread(request.get("paths"))
        file_ids = {f.file_id for f in files}
        self._fetcher.discard_pending(lambda key: key.file_id in file_ids)
        await trio.to_thread.run_sync(self._cache.unpin, list(file_ids))
        freed = 0
        for file_id in file_ids:
            freed += await trio.to_thread.run_sync(self._cache.evict_file, file_id)
        await self._drop_kernel_pages([entry.ino for entry in files])
        return {"files": len(files), "freed_bytes": freed}

    async def purge(self, request: dict[str, Any], progress: Progress) -> dict[str, Any]:
        """Drop every cached block and pin: nothing of the dataset stays in the cache dir."""
        if not request.get("all"):
            raise CachefsError("purge needs --all")
        self._fetcher.discard_pending(lambda key: True)
        await trio.to_thread.run_sync(self._cache.unpin, self._cache.pinned_file_ids())
        blocks = await trio.to_thread.run_sync(self._cache.purge)
        await self._drop_kernel_pages(self._namespace.inode_numbers())  # streamed: a snapshot may have millions
        log.info("purged %d cached blocks", blocks)
        return {"purged_blocks": blocks}


class _WarmJob:
    """One warm-up: fetch the missing blocks of `files`, `parallel` files at a time."""

    def __init__(self, files: list[Inode], fetcher: Fetcher, block_size: int, parallel: int) -> None:
        self.files = files
        self._fetcher = fetcher
        self._block_size = block_size
        self._slots = trio.Semaphore(parallel)
        self.finished = trio.Event()
        self.started_s = time.monotonic()
        self.bytes_total = sum(f.size for f in files)
        self.bytes_done = 0
        self.cached_before_bytes = 0
        self.fetched_bytes = 0
        self.files_done = 0
        self.failed_files = 0
        self._fetched_keys: set[BlockKey] = set()

    async def run(self, scope: trio.CancelScope) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for inode in self.files:
                    await self._slots.acquire()  # bounds the tasks, not only the requests
                    nursery.start_soon(self._warm_file, inode)
            # Done means on disk: wait for the cache writer to commit what was fetched.
            await self._fetcher.written(self._fetched_keys)
        finally:
            self.finished.set()

    async def _warm_file(self, inode: Inode) -> None:
        """Fetch the file's blocks that are neither cached nor in flight, in runs of COALESCE_BLOCKS."""
        try:
            ok = True
            block_size = self._block_size
            count = inode.block_count(block_size)
            accounted = 0  # blocks before this one are counted in bytes_done

            def missing(blockno: int) -> bool:
                return not self._fetcher.in_flight_or_cached(BlockKey(inode.file_id, inode.version, blockno))

            def present_until(stop: int) -> None:
                skipped = sum(inode.block_length(blockno, block_size) for blockno in range(accounted, stop))
                self.cached_before_bytes += skipped
                self.bytes_done += skipped

            for run in missing_runs(range(count), missing, COALESCE_BLOCKS):
                present_until(run[0])
                keys = [BlockKey(inode.file_id, inode.version, blockno) for blockno in run]
                lengths = [inode.block_length(blockno, block_size) for blockno in run]
                self._fetched_keys.update(keys)
                fetched = await self._fetcher.warm(keys, run[0] * block_size, lengths)
                ok &= fetched
                if fetched:
                    self.fetched_bytes += sum(lengths)
                    self.bytes_done += sum(lengths)
                accounted = run[-1] + 1
            present_until(count)
            self.files_done += 1
            self.failed_files += not ok
        finally:
            self._slots.release()

    def report(self) -> dict[str, Any]:
        elapsed_s = max(1e-6, time.monotonic() - self.started_s)
        rate = self.fetched_bytes / elapsed_s
        remaining = self.bytes_total - self.bytes_done
        return {
            "files_total": len(self.files),
            "files_done": self.files_done,
            "failed_files": self.failed_files,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "cached_before_bytes": self.cached_before_bytes,
            "fetched_bytes": self.fetched_bytes,
            "elapsed_s": elapsed_s,
            "rate_bytes_per_s": rate,
            "eta_s": remaining / rate if rate > 0 else None,
        }
