"""A snapshot's files, opened beneath the root only while they are the very inodes scanned."""

from __future__ import annotations

import errno
import os
import stat

from hubserver.beneath import open_beneath
from hubserver.errors import FileChangedError, FileUnavailableError
from hubserver.snapshot import FileRecord, Snapshot, encode_path

# Opening a file that was swapped for a FIFO or a device must never block or
# take a controlling terminal; no component may be a symlink (see beneath.py).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


# Errors of open() that say the path no longer leads to a readable file of the root (it
# was removed, replaced by a symlink or a non-directory, its permissions changed); any
# other (EMFILE, ENFILE, ENOMEM, EIO, ...) says nothing about the file.
_CHANGED_ERRNOS = frozenset(
    {
        errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV, errno.EISDIR,
        errno.ENXIO, errno.ENODEV, errno.EACCES, errno.EPERM,
    }
)


def _open_error(record: FileRecord, exc: OSError) -> Exception:
    """FileChangedError if `exc` (from opening `record`) means the file changed, else
    FileUnavailableError."""
    if exc.errno in _CHANGED_ERRNOS:
        return FileChangedError(f"{record.path!r} cannot be opened: {exc.strerror}")
    return FileUnavailableError(f"{record.path!r} cannot be opened now: {exc.strerror}")


def _matches(record: FileRecord, st: os.stat_result) -> bool:
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == record.size_bytes
        and st.st_mtime_ns == record.mtime_ns
        and st.st_ctime_ns == record.ctime_ns
        and st.st_ino == record.ino
        and st.st_dev == record.dev
    )


def check_unchanged(snapshot: Snapshot, record: FileRecord) -> bool:
    """True if the file on disk still is the one scanned: a regular file with the same
    size, mtime, ctime, device and inode, reached without a symlink in any component of
    its path (as `open_unchanged` opens it: an lstat of the path would follow a directory
    above it swapped for a symlink). Raises FileUnavailableError if that cannot be told
    now. Blocking."""
    try:
        fd = open_unchanged(snapshot, record)
    except FileChangedError:
        return False
    os.close(fd)
    return True


def check_descriptor_unchanged(fd: int, record: FileRecord) -> None:
    """Raise FileChangedError unless the open file still is the scanned one (same size,
    mtime, ctime, inode). Called *after* reading: a write into the file updates its
    mtime and ctime before it changes a byte, so bytes read before a check that
    passes are the scanned version's (a check at open time alone lets a write that
    lands between the open and the read through, under the old version). Blocking."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise FileUnavailableError(f"{record.path!r} cannot be checked now: {exc.strerror}") from None
    if not _matches(record, st):
        raise FileChangedError(f"{record.path!r} changed on disk while it was read")


def read_block(fd: int, record: FileRecord, length: int, offset: int) -> bytes:
    """Up to `length` bytes of an open file of the snapshot at `offset`; an I/O error is
    FileUnavailableError (it may pass; it is no change of the file). Blocking."""
    try:
        return os.pread(fd, length, offset)
    except OSError as exc:
        raise FileUnavailableError(f"{record.path!r} cannot be read now: {exc.strerror}") from None


def open_unchanged(snapshot: Snapshot, record: FileRecord) -> int:
    """Open a file of the snapshot read-only and return the descriptor.

    No symlink is followed on the way, in the last component or any directory
    above it (`open_beneath`): what is opened lies inside the root, and a path
    swapped to lead elsewhere opens nothing there. The descriptor is then
    checked with `fstat`, so what it reads is the very inode that was scanned
    (same device, inode, size, mtime and ctime). Raises FileChangedError
    otherwise, and FileUnavailableError if it cannot be opened for want of
    resources. Blocking.
    """
    try:
        fd = open_beneath(snapshot.root_bytes, encode_path(record.path), _OPEN_FLAGS)
    except OSError as exc:
        raise _open_error(record, exc) from None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise FileUnavailableError(f"{record.path!r} cannot be checked now: {exc.strerror}") from None
    if not _matches(record, st):
        os.close(fd)
        raise FileChangedError(f"{record.path!r} changed on disk since the scan")
    return fd
