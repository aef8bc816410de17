"""FUSE passthrough: the kernel reads a whole, verified cached file straight from its data file.

An open file in passthrough mode has its read() and mmap served by the
kernel from a "backing file", here the cache's data file of that file
version (cache/store.py: block N at offset N x block size), at local disk
speed and without a request to the daemon. It needs Linux >= 6.9 built with
FUSE passthrough, root (CAP_SYS_ADMIN) and a pyfuse3 built with
scripts/install_passthrough_fuse.sh; lacking any of them, every open is
served by the daemon as before.

Such reads skip the daemon's per-read checksum checks, so a file version is
handed to the kernel only when its cache holds every block and all were
verified since the machine booted: read back and checked (BlockCache.verify_files;
this module verifies files in the background after they are read whole),
or, a small file written through the page cache, checked as it was written
(BlockCache.verify_small_files_on_insert, turned on here once the kernel
takes backing files). Its data file is then sealed read-only (store.py), its
blocks are held out of eviction while it is open that way, and reverify.py
re-hashes it on a period: one that changed on disk is `revoke`d.

Kernel rules kept here: every open of an inode already open in passthrough
mode must name the same backing file (one backing id per inode, closed at
its last release); an inode open the ordinary way (through the page cache)
cannot be opened in passthrough mode until those opens are released.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import struct
import tempfile
from typing import Protocol

import pyfuse3
import trio

from ..cache import BlockCache, BlockKey
from ..config import PassthroughMode
from ..errors import DataFileChanged, OpenInAnotherVersion
from ..metrics import Stats
from ..namespace.tree import Inode

log = logging.getLogger(__name__)

# ioctls on /dev/fuse (linux/fuse.h): _IOW(229, 1, struct fuse_backing_map {
# int32 fd; uint32 flags; uint64 padding }) and _IOW(229, 2, uint32 backing id).
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502
_BACKING_MAP = struct.Struct("=iIQ")
_BACKING_ID = struct.Struct("=I")
# Files waiting for background verification, and what goes to the worker
# thread in one hop: up to 64 files (small files: a hop each would cost the
# event loop more than the verification) or 64 MiB, which bounds how long an
# unmount waits for the batch under way.
MAX_PENDING_FILES = 4096
VERIFY_BATCH_FILES = 64
VERIFY_BATCH_BYTES = 64 << 20
# A file is verified this long after its release: its last blocks may still
# be on their way to the cache's writer. One found incomplete is looked at
# again after twice, four and eight times as long (a loaded machine's writer
# can be seconds behind); after that, its next release queues it again.
VERIFY_DELAY_S = 1.0
VERIFY_RETRIES = 3


def supported_by_pyfuse3() -> bool:
    """Whether this pyfuse3 can hand a backing file to the kernel (the patched build)."""
    return hasattr(pyfuse3, "get_session_fd")


def _register_backing(fd: int) -> int:
    """Hand the kernel a backing file (it keeps its own reference); returns its backing id."""
    backing_id: int = fcntl.ioctl(pyfuse3.get_session_fd(), FUSE_DEV_IOC_BACKING_OPEN, bytearray(_BACKING_MAP.pack(fd, 0, 0)))
    return backing_id


class PlanActivity(Protocol):
    """Whether a loader's plan is active (planner.ActivePlans): its reads must then reach the daemon."""

    def active(self) -> bool: ...


@dataclasses.dataclass(slots=True)
class _InodeOpens:
    """The open handles of one inode, all in one mode."""

    inode: Inode
    count: int
    backing_id: int  # 0: served by the daemon
    revoked: bool = False  # its data file failed a re-verification: no new open may share it


class Passthrough:
    """Decides per open whether the kernel reads the file directly, and verifies files for it."""

    def __init__(self, cache: BlockCache, plans: PlanActivity, stats: Stats, *, mode: PassthroughMode) -> None:
        """`mode`: use passthrough where possible (AUTO), or asked for it (ON: its being
        unavailable is then a warning rather than a note), or not at all (OFF)."""
        self._cache = cache
        self._plans = plans
        self._stats = stats
        self._requested = mode is PassthroughMode.ON
        wanted = mode is not PassthroughMode.OFF
        self.enabled = wanted and supported_by_pyfuse3()
        if wanted and not self.enabled:
            self._note_unavailable("this pyfuse3 cannot hand files to the kernel; scripts/install_passthrough_fuse.sh "
                                   "builds one that can")
        self._opens: dict[int, _InodeOpens] = {}
        self._pending: dict[tuple[bytes, bytes], tuple[Inode, float, int]] = {}  # -> (inode, due, retry), due in order
        self._pending_added = trio.Event()

    def probe(self) -> None:
        """After FUSE_INIT: find out whether the kernel takes backing files from this
        daemon (needs the kernel's support, negotiated at init, and root)."""
        if not self.enabled:
            return
        try:
            with tempfile.TemporaryFile(dir=self._cache.store.data_dir) as probe:
                backing_id = _register_backing(probe.fileno())
            self._close_backing(backing_id)
        except OSError as exc:
            self._give_up(exc)
            return
        self._cache.verify_small_files_on_insert(True)
        log.info("FUSE passthrough: the kernel reads whole verified cached files directly")

    # -- opens and releases (trio thread) ---------------------------------------------

    def open(self, inode: Inode) -> int:
        """The backing id for a new open of `inode`, or 0 to serve it through the daemon.

        Raises OpenInAnotherVersion if the inode is open in passthrough mode in an older
        version (a refresh changed the file): the kernel allows one backing file per inode.
        """
        opens = self._opens.get(inode.ino)
        if opens is not None:
            if opens.backing_id and opens.inode.version != inode.version:
                raise OpenInAnotherVersion(f"inode {inode.ino} is open in passthrough mode in an older version")
            if opens.revoked:
                raise DataFileChanged(f"inode {inode.ino} is open in passthrough mode on a data file that changed on disk")
            opens.count += 1
        else:
            opens = self._opens[inode.ino] = _InodeOpens(inode, 1, self._backing_id(inode))
        if opens.backing_id:
            self._stats.passthrough_opens += 1
        return opens.backing_id

    def release(self, inode: Inode) -> None:
        """One open of `inode` was released; the last one closes its backing file."""
        opens = self._opens.get(inode.ino)
        if opens is None:
            return
        opens.count -= 1
        if opens.count > 0:
            return
        del self._opens[inode.ino]
        inode = opens.inode  # the version the opens were made in
        if opens.backing_id:
            self._close_backing(opens.backing_id)
            self._cache.unhold(inode.file_id, inode.version)
        else:
            self._queue_verification(inode)

    def filled(self, inode: Inode) -> None:
        """A background fill went through `inode`: verify it now, not at its last release
        (a loader may keep it open all epoch), so that its next opens are read by the kernel."""
        self._queue_verification(inode)

    def revoke(self, file_id: bytes, version: bytes) -> None:
        """A file version's data file changed on disk after its verification (reverify.py):
        its verified mark is gone, so later opens are served by the daemon; opens of it in
        passthrough mode now keep their backing file (the kernel cannot switch an open file)
        and no new open may join them until they close."""
        for opens in self._opens.values():
            if opens.backing_id and opens.inode.file_id == file_id and opens.inode.version == version:
                opens.revoked = True
                log.error("inode %d is open in passthrough mode on a data file that changed on disk: new opens fail "
                          "until its %d open handles close", opens.inode.ino, opens.count)

    def _backing_id(self, inode: Inode) -> int:
        """Register the inode's data file with the kernel if it may be read directly; else 0."""
        if not self.enabled or inode.size == 0 or self._plan_active():
            return 0
        if not self._cache.hold(inode.file_id, inode.version):
            return 0
        backing_id = 0
        try:
            unlinks = self._cache.unlinks()
            if self._cache.verified(inode.file_id, inode.version):
                backing_id = self._open_backing(inode, unlinks)
        finally:
            if not backing_id:
                self._cache.unhold(inode.file_id, inode.version)
        if backing_id:
            self._note_blocks_used(inode)
        return backing_id

    def _plan_active(self) -> bool:
        """A loader's plan follows its reads block by block: keep them in the daemon then."""
        return self._plans.active()

    def _open_backing(self, inode: Inode, unlinks: int) -> int:
        """Register the inode's data file, verified while the cache's unlink count was `unlinks`."""
        try:
            fd = os.open(self._cache.store.path(inode.file_id, inode.version), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot open the data file of inode %d: %s", inode.ino, exc)
            return 0
        try:
            if self._cache.unlinks() != unlinks:  # it may be a new data file at that path (BlockCache.unlinks)
                return 0
            if os.fstat(fd).st_size != inode.size:
                log.warning("the data file of inode %d is not %d bytes long; serving it through the daemon",
                            inode.ino, inode.size)
                return 0
            return _register_backing(fd)
        except OSError as exc:
            self._give_up(exc)
            return 0
        finally:
            os.close(fd)

    def _give_up(self, exc: OSError) -> None:
        """The kernel refused a backing file: no passthrough for this mount."""
        self.enabled = False
        self._cache.verify_small_files_on_insert(False)
        self._pending.clear()
        self._note_unavailable("not root" if exc.errno == errno.EPERM else str(exc.strerror))

    def _note_unavailable(self, reason: str) -> None:
        """One line: a warning if --passthrough was asked for, else a note (the default falls back quietly)."""
        log.log(logging.WARNING if self._requested else logging.INFO,
                "FUSE passthrough is not available (%s); the daemon serves and checks every read", reason)

    def _close_backing(self, backing_id: int) -> None:
        try:
            fcntl.ioctl(pyfuse3.get_session_fd(), FUSE_DEV_IOC_BACKING_CLOSE, bytearray(_BACKING_ID.pack(backing_id)))
        except OSError as exc:
            log.warning("cannot close backing file %d: %s", backing_id, exc)

    def _note_blocks_used(self, inode: Inode) -> None:
        """The kernel's reads never reach the daemon: count the open as a use of
        each block, so the eviction policy still sees the file as popular."""
        for blockno in range(inode.block_count(self._cache.store.block_size)):
            self._cache.sketch.record(BlockKey(inode.file_id, inode.version, blockno))

    # -- background verification ------------------------------------------------------

    def _queue_verification(self, inode: Inode, retry: int = 0) -> None:
        if not self.enabled or inode.size == 0:  # an empty file has no data file to verify
            return
        key = (inode.file_id, inode.version)
        if key in self._pending or len(self._pending) >= MAX_PENDING_FILES:
            return
        if self._cache.verified(inode.file_id, inode.version):
            return
        self._pending[key] = (inode, trio.current_time() + VERIFY_DELAY_S * 2**retry, retry)
        self._pending_added.set()

    async def run_verifier(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Verify released files in a worker thread, a batch at a time, until cancelled."""
        task_status.started()
        while True:
            await self._pending_added.wait()
            self._pending_added = trio.Event()
            while self._pending:
                _inode, due, _retry = next(iter(self._pending.values()))
                await trio.sleep_until(due)
                # A small file is mostly verified by the cache writer after its release queued it:
                # looked up here (an index read), not in a worker thread, it costs no thread hop.
                batch = [(inode, retry) for inode, retry in self._next_batch()
                         if not self._cache.verified(inode.file_id, inode.version)]
                if not batch:
                    continue
                marked = await trio.to_thread.run_sync(self._verify, [inode for inode, _retry in batch])
                self._stats.verified_files += len(marked)
                for inode, retry in batch:
                    if (inode.file_id, inode.version) not in marked and retry < VERIFY_RETRIES:
                        self._queue_verification(inode, retry + 1)

    def _next_batch(self) -> list[tuple[Inode, int]]:
        """Due files (with their retry), oldest first, up to a batch's count and bytes."""
        batch: list[tuple[Inode, int]] = []
        taken = []
        size = 0
        now = trio.current_time()
        for key, (inode, due, retry) in self._pending.items():  # not copied: up to 4096 files wait
            if due > now or (batch and (len(batch) >= VERIFY_BATCH_FILES or size >= VERIFY_BATCH_BYTES)):
                break
            taken.append(key)
            batch.append((inode, retry))
            size += inode.size
        for key in taken:
            del self._pending[key]
        return batch

    def _verify(self, inodes: list[Inode]) -> set[tuple[bytes, bytes]]:
        """Worker thread: check each file whole (an incomplete one is skipped after
        its index entries); returns the (file id, version) of those marked verified."""
        block_size = self._cache.store.block_size
        return self._cache.verify_files([
            (inode.file_id, inode.version,
             [inode.block_length(blockno, block_size) for blockno in range(inode.block_count(block_size))])
            for inode in inodes
        ])
