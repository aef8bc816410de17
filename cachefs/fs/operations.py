"""pyfuse3 Operations: a read-only view of the snapshot. The only place that raises FUSEError.

Any exception other than FUSEError escaping a handler would end
pyfuse3.main() and the mount with it, so every handler goes through
`_guarded`, which logs and answers EIO.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import json
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import pyfuse3
import trio

from ..config import Ownership
from ..errors import DataFileChanged, HubError, OpenInAnotherVersion, RemoteFileChanged
from ..metrics import READ_DURATION, Stats
from ..namespace.tree import KIND_DIR, KIND_FILE, Changes, Inode, Namespace
from ..read.handles import OpenFiles
from ..read.reader import Reader
from .failed_reads import FailedReads
from .passthrough import Passthrough

log = logging.getLogger(__name__)

STATS_XATTR = b"user.cachefs.stats"
_KIND_BITS = {KIND_DIR: stat.S_IFDIR, KIND_FILE: stat.S_IFREG}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])
# Answers that are part of normal use, not failures worth counting.
_ROUTINE_ERRNOS = {errno.ENOENT, pyfuse3.ENOATTR}


def _guarded(handler: F) -> F:
    """Turn unexpected exceptions into a logged EIO instead of a dead mount."""

    @functools.wraps(handler)
    async def wrapper(self: CachefsOperations, *args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(self, *args, **kwargs)
        except pyfuse3.FUSEError as exc:
            if exc.errno not in _ROUTINE_ERRNOS:
                self.stats.fuse_errors[handler.__name__] += 1
            raise
        except Exception:
            log.exception("unexpected error in %s", handler.__name__)
            self.stats.fuse_errors[handler.__name__] += 1
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def _forget_in_kernel(invalidate: Callable[..., None], *args: Any) -> bool:
    """Tell the kernel to forget a name or an inode (pyfuse3.invalidate_*; a worker thread):
    nothing if it did not know it. Returns whether it knew it (True also after another
    error, logged: it may have)."""
    try:
        invalidate(*args)
    except OSError as exc:  # ENOENT: the kernel did not know it, nothing to forget
        if exc.errno != errno.ENOENT:
            log.warning("cannot invalidate %s: %s", args, exc)
            return True
        return False
    return True


_forget_attributes = functools.partial(pyfuse3.invalidate_inode, attr_only=True)


def drop_kernel_pages(inodes: Iterable[int]) -> set[int]:
    """Make the kernel drop the attributes and pages it holds of these inodes (a worker thread):
    after a refresh, what changed; after `cachefs evict` and `purge`, no dataset bytes stay in
    memory for a reader to be served. Returns the inodes the kernel held."""
    return {ino for ino in inodes if _forget_in_kernel(pyfuse3.invalidate_inode, ino)}


async def _read_only_async(*_args: Any, **_kwargs: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


class PageCacheVersions:
    """Keeps each open from reading another version's bytes out of the kernel's page cache.

    Inode numbers survive a new generation (they are hashes of the path), so
    both versions of a file changed by a refresh share one kernel inode and
    its page cache. A handle opened before the refresh keeps reading its
    version, and those pages stay in the cache: an open of the new version
    would be served them. So an open of version V of an inode on which a
    handle of another version is open bypasses the page cache (direct_io);
    and the first open of V after such handles are all closed drops the
    inode's pages (keep_cache off). Only inodes with another version's pages
    are remembered (bounded by what refreshes changed while it was open).
    While a refresh loads a new generation and until the kernel has been told
    what changed, no open keeps the page cache: a changed file's old pages
    may still be there for an open of the new version.
    """

    def __init__(self) -> None:
        self._open: dict[int, collections.Counter[bytes]] = {}  # inode -> versions of its cached-read handles
        self._stale: dict[int, bytes] = {}  # inode -> version whose pages it may still hold
        self._refreshes = 0  # refreshes between their load and the kernel's invalidation

    def open(self, inode: Inode) -> tuple[bool, bool]:
        """(direct_io, keep_cache) for a new handle of this inode's version."""
        versions = self._open.get(inode.ino)
        if versions is not None and any(version != inode.version for version in versions):
            return True, False
        self._open.setdefault(inode.ino, collections.Counter())[inode.version] += 1
        same_pages = self._stale.pop(inode.ino, inode.version) == inode.version
        return False, same_pages and not self._refreshes

    @contextlib.contextmanager
    def refreshing(self) -> Iterator[None]:
        """Around a refresh's load and its telling the kernel what changed."""
        self._refreshes += 1
        try:
            yield
        finally:
            self._refreshes -= 1

    def release(self, inode: Inode, current: Inode | None) -> bool:
        """A handle opened with (False, ...) closed; `current`: the namespace's inode now.
        True if it was the last handle of a version the namespace no longer shows."""
        versions = self._open[inode.ino]
        versions[inode.version] -= 1
        replaced = False
        if versions[inode.version] <= 0:
            del versions[inode.version]
            if current is None or current.version != inode.version:
                self._stale[inode.ino] = inode.version
                replaced = True
        if not versions:
            del self._open[inode.ino]
        return replaced


class ReplacedInKernel:
    """Files whose kernel inode may still be of a version a refresh replaced (--nfs-export).

    A file's versions share its inode number; only the FUSE generation tells
    them apart, and the kernel learns a new generation only from a lookup of
    the name (or a readdirplus). Until then it keeps the old version's inode
    and accepts that version's handles, so a getattr or open of such an inode
    answers ESTALE: what an NFS server holds of the old version turns stale
    instead of reading the new version beside attributes it cached of the old.
    Only inodes the kernel held when the refresh told it are listed, and each
    leaves at the kernel's next lookup or forget of it (bounded by the kernel's
    inode cache). During a refresh, what the kernel was told is noted, so that
    an inode it got the new version of before the refresh listed its files is
    left out.
    """

    def __init__(self) -> None:
        self._replaced: set[int] = set()
        self._told: dict[int, bytes | None] | None = None  # during a refresh: version told, None if forgotten

    @contextlib.contextmanager
    def refreshing(self) -> Iterator[None]:
        """Around a refresh's load and its telling the kernel what changed."""
        self._told = {}
        try:
            yield
        finally:
            self._told = None

    def replaced(self, files: dict[int, bytes]) -> None:
        """Files (inode -> new version) the refresh gave a new version that the kernel holds;
        before the kernel is told to look them up again."""
        told = self._told or {}
        for ino, version in files.items():
            if ino not in told or told[ino] not in (version, None):
                self._replaced.add(ino)

    def told(self, ino: int, version: bytes) -> None:
        """The kernel got this inode's current generation (a lookup or readdirplus answered)."""
        if self._told is not None:
            self._told[ino] = version
        self._replaced.discard(ino)

    def forgotten(self, ino: int) -> None:
        """The kernel no longer holds the inode (FORGET), or the inode is gone from the namespace."""
        if self._told is not None:
            self._told[ino] = None
        self._replaced.discard(ino)

    def __contains__(self, ino: int) -> bool:
        return ino in self._replaced

    def __len__(self) -> int:
        return len(self._replaced)


class CachefsOperations(pyfuse3.Operations):
    """Serves lookups from the namespace and reads through the reader."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        namespace: Namespace,
        reader: Reader,
        handles: OpenFiles,
        passthrough: Passthrough,
        stats: Stats,
        failed_reads: FailedReads,
        *,
        ownership: Ownership,
        attr_timeout_s: float,
        stats_json: Callable[[], dict[str, Any]],
        version_generations: bool = False,
    ) -> None:
        super().__init__()
        self._namespace = namespace
        self._reader = reader
        self._passthrough = passthrough
        self._failed_reads = failed_reads
        self.enable_passthrough = passthrough.enabled  # read by pyfuse3 at FUSE_INIT (patched build)
        self.stats = stats
        self._ownership = ownership
        self._attr_timeout_s = attr_timeout_s
        self._version_generations = version_generations
        self._stats_json = stats_json
        self._handles = handles
        self._cached_handles: set[int] = set()  # read through the kernel's page cache (PageCacheVersions)
        self._page_cache = PageCacheVersions()
        self._replaced_in_kernel = ReplacedInKernel()
        self.initialized = False  # set once the kernel's FUSE_INIT was answered

    def init(self) -> None:
        self.initialized = True

    # -- metadata ---------------------------------------------------------------

    def _inode(self, ino: int) -> Inode:
        inode = self._namespace.get(ino)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return inode

    def _attributes(self, inode: Inode) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode.ino
        attr.st_mode = _KIND_BITS.get(inode.kind, stat.S_IFLNK) | self._ownership.mode(inode.is_dir, inode.is_file, inode.mode)
        attr.st_nlink = 2 if inode.is_dir else 1
        attr.st_size = inode.size
        attr.st_uid, attr.st_gid = self._ownership.uid, self._ownership.gid
        attr.st_blksize = self._reader.block_size
        attr.st_blocks = (inode.size + 511) // 512
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = inode.mtime_ns
        attr.attr_timeout = attr.entry_timeout = self._attr_timeout_s
        if self._version_generations and inode.is_file:
            # A new version is a new file to the kernel: its handles of the old one turn stale.
            attr.generation = int.from_bytes(inode.version[:4], "big")
        return attr

    @contextlib.contextmanager
    def refreshing(self) -> Iterator[None]:
        """Around a refresh's load and its telling the kernel what changed (PageCacheVersions, and
        under --nfs-export ReplacedInKernel: without generations nothing is refused, so nothing
        the kernel is told needs noting)."""
        noting = self._replaced_in_kernel.refreshing() if self._version_generations else contextlib.nullcontext()
        with self._page_cache.refreshing(), noting:
            yield

    async def tell_kernel(self, changes: Changes) -> None:
        """Make the kernel forget attributes, names and pages of what a new generation changed.
        Under --nfs-export the files of a new version the kernel holds are refused first
        (ReplacedInKernel), before their names are forgotten: lookups come then."""
        held = await trio.to_thread.run_sync(drop_kernel_pages, changes.changed)
        if self._version_generations:
            files = await trio.to_thread.run_sync(self._files_of_new_versions, changes, held)
            self._replaced_in_kernel.replaced(files)

        def forget_names() -> None:
            for parent, name, ino in changes.removed:
                _forget_in_kernel(pyfuse3.invalidate_entry, parent, name)
                _forget_in_kernel(pyfuse3.invalidate_inode, ino)
            for parent, name in changes.added:  # to be looked up again (NamespaceChanges.added)
                _forget_in_kernel(pyfuse3.invalidate_entry, parent, name)
            if self._version_generations:  # a new generation: to be looked up again too
                for parent, name in changes.renewed:
                    _forget_in_kernel(pyfuse3.invalidate_entry, parent, name)

        await trio.to_thread.run_sync(forget_names)
        for _parent, _name, ino in changes.removed:
            self._replaced_in_kernel.forgotten(ino)

    def _files_of_new_versions(self, changes: Changes, held: set[int]) -> dict[int, bytes]:
        """Inode -> version of the files of a new version whose inode the kernel held (a worker
        thread: one index read each)."""
        files = (self._namespace.lookup(parent, name) for parent, name in changes.renewed)
        return {inode.ino: inode.version for inode in files if inode is not None and inode.is_file and inode.ino in held}

    @_guarded
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if inode in self._replaced_in_kernel:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return self._attributes(self._inode(inode))

    @_guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        parent = self._inode(parent_inode)
        if name == b".":  # a kernel handle of an inode it does not hold
            self._replaced_in_kernel.told(parent.ino, parent.version)
            return self._attributes(parent)
        if name == b"..":
            return self._attributes(self._inode(parent.parent))
        child = self._namespace.lookup(parent_inode, name)
        if child is None:
            # A negative entry the kernel may cache: the snapshot cannot change.
            attr = pyfuse3.EntryAttributes()
            attr.st_ino = 0
            attr.entry_timeout = self._attr_timeout_s
            return attr
        self._replaced_in_kernel.told(child.ino, child.version)
        return self._attributes(child)

    @_guarded
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        entry = self._inode(inode)
        if entry.is_dir or entry.is_file:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return entry.target

    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self._inode(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        for next_id, name, child in self._namespace.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._attributes(child), next_id):
                return
            self._replaced_in_kernel.told(child.ino, child.version)

    @_guarded
    async def releasedir(self, fh: int) -> None:
        return None

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        summary = self._namespace.summary()
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = self._reader.block_size
        data.f_blocks = (summary.file_bytes if summary else 0) // self._reader.block_size + 1
        data.f_bfree = data.f_bavail = 0
        data.f_files = summary.entries if summary else 1
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data

    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == STATS_XATTR:
            return json.dumps(self._stats_json()).encode()
        self._inode(inode)
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @_guarded
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        self._inode(inode)
        return []

    # -- data -------------------------------------------------------------------

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        entry = self._inode(inode)
        if not entry.is_file:
            raise pyfuse3.FUSEError(errno.EISDIR if entry.is_dir else errno.EINVAL)
        if inode in self._replaced_in_kernel:
            raise pyfuse3.FUSEError(errno.ESTALE)
        try:
            backing_id = self._passthrough.open(entry)
        except OpenInAnotherVersion as exc:
            log.error("cannot open inode %d until its earlier opens close: %s", inode, exc)
            raise pyfuse3.FUSEError(errno.ESTALE) from None
        except DataFileChanged as exc:
            log.error("cannot open inode %d until its earlier opens close: %s", inode, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        handle_id = self._handles.add(self._reader.open(entry, ctx.pid, passthrough=bool(backing_id)))
        if backing_id:
            # The kernel reads the cache's data file itself (its own page cache).
            return pyfuse3.FileInfo(fh=handle_id, keep_cache=False, backing_id=backing_id)
        # A file version's bytes never change: keep the page cache (unless another version's is in it).
        direct_io, keep_cache = self._page_cache.open(entry)
        if direct_io:
            log.info("inode %d is open in another version: this open bypasses the page cache", inode)
        else:
            self._cached_handles.add(handle_id)
        return pyfuse3.FileInfo(fh=handle_id, keep_cache=keep_cache, direct_io=direct_io)

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]  # pyfuse3 sends any buffer; its stub says bytes
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if self._version_generations and self._replaced(handle.inode):
            # An NFS server's handle of a version a refresh replaced: stale, never read beside new attributes.
            raise pyfuse3.FUSEError(errno.ESTALE)
        started = time.monotonic()
        inode = handle.inode
        block_size = self._reader.block_size
        blocks = range(off // block_size, (min(off + size, inode.size) + block_size - 1) // block_size)
        failed = self._failed_reads.failure(inode.file_id, inode.version, blocks, started)
        if failed is not None:  # the kernel asking again for pages whose read just failed: not a second wait
            log.error("cannot read %d bytes at %d of inode %d: %s", size, off, inode.ino, failed)
            raise pyfuse3.FUSEError(errno.EIO)
        answers = self._failed_reads.answers()
        try:
            return await self._reader.read(handle, off, size)
        except RemoteFileChanged as exc:
            log.error("cannot read %d bytes at %d of inode %d: %s", size, off, inode.ino, exc)
            raise pyfuse3.FUSEError(errno.ESTALE) from None
        except HubError as exc:
            log.error("cannot read %d bytes at %d of inode %d: %s", size, off, inode.ino, exc)
            self._failed_reads.read_failed(inode.file_id, inode.version, blocks, exc, answers, time.monotonic())
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            READ_DURATION.observe(time.monotonic() - started)

    def _replaced(self, inode: Inode) -> bool:
        current = self._namespace.get(inode.ino)
        return current is None or current.version != inode.version

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, _lookups in inode_list:
            self._replaced_in_kernel.forgotten(ino)

    @_guarded
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        if handle is not None:
            handle.closed = True  # read-ahead not yet started for it is dropped
            self._passthrough.release(handle.inode)
            if fh in self._cached_handles:
                self._cached_handles.discard(fh)
                if self._page_cache.release(handle.inode, self._namespace.get(handle.inode.ino)):
                    # A read of it that ended short at its old end set the kernel's size back to the
                    # old version's: the next stat and open must ask for the current one.
                    await trio.to_thread.run_sync(_forget_in_kernel, _forget_attributes, handle.inode.ino)

    # No `flush`: pyfuse3 answers the first FLUSH with ENOSYS and the kernel then
    # stops sending one on every close() (nothing here is ever dirty). That is a
    # quarter of the requests of a small-file read (open, read, flush, release).

    @_guarded
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        self._inode(inode)
        return not (mode & os.W_OK)

    # -- everything that would change the tree ------------------------------------

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only_async
    create = write = setxattr = removexattr = _read_only_async

    async def fsync(self, fh: int, datasync: bool) -> None:
        return None  # nothing is ever dirty

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None
