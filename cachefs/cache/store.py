"""Block data on local disk: one sparse data file per hub file version, under data/<2 hex>/.

Block N of a file lives at offset N x block size of its data file, so a
sequential read of a cached file is a sequential read of one local file and
gets the kernel's readahead (docs/performance.md). Evicting a block punches a
hole (fallocate), which returns its disk space at once.

Whole blocks are written with O_DIRECT: straight from their buffer when it
is page-aligned (a slot of the block buffer pool), else copied through one
page-aligned buffer. Written through the page cache, a fetched block was held twice in
memory (it is in the FUSE file's page cache already), cost a page
allocation and a copy per 4 KiB, and left dirty pages whose writeback
landed on later index commits (docs/performance.md has the cost). A file's short
last block (every small file) still goes through the page cache: O_DIRECT
needs aligned lengths, and padding would change the data file's size, which
passthrough hands to the kernel. A file system that refuses O_DIRECT
(ramfs) gets page-cache writes for every block.

A data file verified whole for the kernel's direct reads (passthrough) is
sealed read-only (mode 0400): the store refuses to write into it, and a
block is dropped from it only after unsealing it, so no write of the daemon
changes bytes the kernel serves without a check.

A block is written before its index entry is committed (block_cache.py);
a block cut short by a crash has no entry, and every read is checked
against the checksums in its entry, so a torn write is never served.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
from pathlib import Path

from ..buffers import BlockBuffers, Buffer, page_aligned, unfilled_buffer
from .keys import BlockData, BlockKey

log = logging.getLogger(__name__)

SEALED_MODE = 0o400
UNSEALED_MODE = 0o600
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
# Blocks whose length is a multiple of this (every block but a file's last)
# are written with O_DIRECT, straight from a page-aligned buffer (a pool
# slot) or copied through one page-aligned buffer of
# DIRECT_CHUNK_BYTES. See write().
DIRECT_ALIGN = 4096
DIRECT_CHUNK_BYTES = 1 << 20


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free [offset, offset + length) of a file's disk space; the file keeps its size."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def can_free_space(fd: int) -> bool:
    """Whether the file system of an open, writable file can give back part of a file's space
    (fallocate punch hole), which every eviction needs: ramfs cannot (EOPNOTSUPP). Writes 8 KiB
    to the file. A write that fails (a full disk) cannot tell, and counts as yes."""
    try:
        os.pwrite(fd, bytes(2 * DIRECT_ALIGN), 0)
        punch_hole(fd, 0, DIRECT_ALIGN)
    except OSError as exc:
        return exc.errno != errno.EOPNOTSUPP
    return True


class SealedDataFile(OSError):
    """A write into a data file sealed for the kernel's direct reads (a bug, refused)."""


class BlockStore:
    """Read, write and drop blocks in per-file sparse data files."""

    def __init__(self, cache_dir: Path, block_size: int, buffers: BlockBuffers | None = None) -> None:
        self.data_dir = cache_dir / "data"
        self.block_size = block_size
        self._take = buffers.take if buffers is not None else unfilled_buffer  # what a block is read into
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        self._data_dir = str(self.data_dir)
        self._direct = True  # whole blocks are written with O_DIRECT while the file system allows it
        self._nowait = True  # whether the file system answers RWF_NOWAIT reads (tmpfs and ramfs do not)
        self._aligned = mmap.mmap(-1, DIRECT_CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
        self._aligned_lock = threading.Lock()

    def path(self, file_id: bytes, version: bytes) -> str:
        """The data file of a file version (a str: pathlib's joins cost ~5 % of a warm read)."""
        name = file_id.hex()
        return f"{self._data_dir}/{name[:2]}/{name}-{version.hex()}"

    def read(self, key: BlockKey, start: int, length: int, *, nowait: bool = False,
             from_disk: bool = False) -> BlockData | None:
        """`length` bytes at `start` of the block, or None if its data file is missing or short.

        With `nowait`, only bytes already in the page cache are read: if any
        of them would need the disk, BlockingIOError is raised instead
        (preadv2 RWF_NOWAIT), so the caller can read them in a worker thread.
        On a file system that cannot tell (EOPNOTSUPP: tmpfs, ramfs), every
        `nowait` read raises BlockingIOError.

        With `from_disk`, whole pages are read with O_DIRECT into a pool slot,
        as they were written: a check of what the disk holds, which neither
        fills the page cache nor is answered from it. Unaligned pieces (a
        file's short last block), a heap buffer (no slot free) and a file
        system that refuses O_DIRECT are read through the page cache.
        """
        if nowait and not self._nowait:
            raise BlockingIOError(errno.EAGAIN, "the file system cannot read without waiting")
        path = self.path(key.file_id, key.version)
        offset = key.blockno * self.block_size + start
        buffer = None if nowait else self._take(length)  # filled whole, or dropped
        direct = (from_disk and self._direct and buffer is not None and offset % DIRECT_ALIGN == 0
                  and length % DIRECT_ALIGN == 0 and page_aligned(buffer, DIRECT_ALIGN))
        try:
            fd = self._open_for_read(path, direct)
        except FileNotFoundError:
            return None
        try:
            if buffer is None:
                return self._read_nowait(fd, offset, length)
            done = self._read_at(fd, buffer, offset, direct)
        finally:
            os.close(fd)
        return buffer if done == length else None

    def _open_for_read(self, path: str, direct: bool) -> int:
        """A read fd of the data file: O_DIRECT if `direct` and the file system allows it."""
        if direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._stop_direct(exc)
        return os.open(path, os.O_RDONLY)

    def _read_at(self, fd: int, buffer: Buffer, offset: int, direct: bool) -> int:
        """Bytes read into `buffer` at offset; an O_DIRECT read the disk refuses (its sector
        size is larger than a page) is made again through the page cache."""
        try:
            return os.preadv(fd, [buffer], offset)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._stop_direct(exc, fd)
            return os.preadv(fd, [buffer], offset)

    def start_reading(self, files: list[tuple[bytes, bytes, int]]) -> None:
        """Have the kernel start reading these data files (file id, version, bytes) into
        the page cache (POSIX_FADV_WILLNEED: it does not wait for the disk); best effort."""
        for file_id, version, size in files:
            try:
                fd = os.open(self.path(file_id, version), os.O_RDONLY)
            except OSError:
                continue  # dropped meanwhile
            try:
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def _read_nowait(self, fd: int, offset: int, length: int) -> Buffer:
        """`length` bytes at `offset` if all are in the page cache, else BlockingIOError."""
        buffer = self._take(length)  # filled whole, or dropped
        try:
            done = os.preadv(fd, [buffer], offset, os.RWF_NOWAIT)
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
            log.info("the cache's file system cannot read without waiting (%s): cached blocks are read in worker threads", exc)
            self._nowait = False
            raise BlockingIOError(errno.EAGAIN, "the file system cannot read without waiting") from None
        if done != length:
            raise BlockingIOError(errno.EAGAIN, "partly on disk only")
        return buffer

    def buffered(self, length: int) -> bool:
        """Whether a block of `length` bytes is written through the page cache (not O_DIRECT)."""
        return not self._direct or length % DIRECT_ALIGN != 0

    def write(self, key: BlockKey, data: BlockData) -> None:
        """Write a block in place (raises OSError, e.g. ENOSPC)."""
        path = self.path(key.file_id, key.version)
        offset = key.blockno * self.block_size
        fd, direct = self._open_for_write(path, not self.buffered(len(data)))
        if not os.fstat(fd).st_mode & 0o200:  # root may write any mode: the seal is checked here
            os.close(fd)
            raise SealedDataFile(errno.EPERM, f"the data file of {key} is sealed")
        try:
            written = self._write_at(fd, data, offset, direct)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write of {key}")
        except OSError:
            with contextlib.suppress(OSError):  # give back what a partial write took
                punch_hole(fd, offset, self.block_size)
            raise
        finally:
            os.close(fd)

    def _open_for_write(self, path: str, direct: bool) -> tuple[int, bool]:
        """A write fd of the data file (created), and whether it is O_DIRECT."""
        flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0)
        try:
            try:
                return os.open(path, flags, UNSEALED_MODE), direct
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                return os.open(path, flags, UNSEALED_MODE), direct
            except PermissionError:  # sealed (a daemon that is not root)
                raise SealedDataFile(errno.EPERM, f"the data file {path} is sealed") from None
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._stop_direct(exc)
            return self._open_for_write(path, False)

    def _write_at(self, fd: int, data: BlockData, offset: int, direct: bool) -> int:
        """Bytes written at offset: with O_DIRECT if `direct` (falling back if refused), else buffered."""
        if direct:
            try:
                return self._pwrite_direct(fd, data, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._stop_direct(exc, fd)
        return os.pwrite(fd, data, offset)

    def _pwrite_direct(self, fd: int, data: BlockData, offset: int) -> int:
        """pwrite with O_DIRECT: a page-aligned block (a pool slot) as it is, any other through
        the page-aligned buffer O_DIRECT needs, DIRECT_CHUNK_BYTES at a time."""
        if page_aligned(data, DIRECT_ALIGN):
            return os.pwrite(fd, data, offset)
        source = memoryview(data)
        written = 0
        with self._aligned_lock, memoryview(self._aligned) as aligned:
            while written < len(source):
                piece = source[written : written + DIRECT_CHUNK_BYTES]
                aligned[: len(piece)] = piece
                done = os.pwrite(fd, aligned[: len(piece)], offset + written)
                written += done
                if done < len(piece):
                    break
        return written

    def _stop_direct(self, exc: OSError, fd: int | None = None) -> None:
        """Go through the page cache from now on, and on `fd` (opened with O_DIRECT) too."""
        if self._direct:
            log.info("the cache's file system refuses O_DIRECT (%s): blocks go through the page cache", exc)
        self._direct = False
        if fd is not None:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)

    def seal(self, file_id: bytes, version: bytes) -> None:
        """Make a verified data file read-only: the kernel may now read it without a check."""
        try:
            os.chmod(self.path(file_id, version), SEALED_MODE)
        except OSError as exc:
            log.warning("cannot seal the data file of file %s: %s", file_id.hex(), exc)

    def unseal(self, file_id: bytes, version: bytes) -> None:
        """Make a data file writable again: a block of it is being dropped, so it is no longer verified."""
        with contextlib.suppress(FileNotFoundError):
            os.chmod(self.path(file_id, version), UNSEALED_MODE)

    def delete(self, key: BlockKey) -> None:
        """Drop a block's bytes from disk (a hole in its data file, which is unsealed first)."""
        path = self.path(key.file_id, key.version)
        try:
            os.chmod(path, UNSEALED_MODE)
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            punch_hole(fd, key.blockno * self.block_size, self.block_size)
        except OSError as exc:
            log.warning("cannot free %s on disk: %s", key, exc)
        finally:
            os.close(fd)

    def data_dirs(self) -> list[Path]:
        """The directories data files are spread over (by the first two hex digits of their file id)."""
        return sorted(path for path in self.data_dir.iterdir() if path.is_dir())

    @staticmethod
    def data_files(directory: Path) -> list[tuple[bytes, bytes]]:
        """(file id, version) of every data file in one of `data_dirs`."""
        files = []
        for path in directory.iterdir():
            name, _dash, version = path.name.partition("-")
            try:
                file_id, version_bytes = bytes.fromhex(name), bytes.fromhex(version)
            except ValueError:
                continue
            if len(file_id) == 8 and len(version_bytes) == 8:
                files.append((file_id, version_bytes))
        return files

    def allocated_blocks(self, file_id: bytes, version: bytes) -> set[int]:
        """Block numbers of a data file with bytes on disk (SEEK_DATA / SEEK_HOLE)."""
        try:
            fd = os.open(self.path(file_id, version), os.O_RDONLY)
        except FileNotFoundError:
            return set()
        blocks: set[int] = set()
        try:
            offset = 0
            while True:
                try:
                    start = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError as exc:  # ENXIO: no data past `offset`
                    if exc.errno == errno.ENXIO:
                        return blocks
                    raise
                stop = os.lseek(fd, start, os.SEEK_HOLE)
                blocks.update(range(start // self.block_size, -(-stop // self.block_size)))
                offset = stop
        finally:
            os.close(fd)

    def delete_file(self, file_id: bytes) -> None:
        """Remove the data files of every version of a hub file."""
        for path in (self.data_dir / file_id.hex()[:2]).glob(f"{file_id.hex()}-*"):
            path.unlink(missing_ok=True)

    def delete_version(self, file_id: bytes, version: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(file_id, version))

    def delete_all(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
