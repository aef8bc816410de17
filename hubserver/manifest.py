"""Scanning the root into a snapshot, and the manifest that describes it.

A snapshot is taken once, at start. Paths are handled as bytes while
scanning, so the result does not depend on the locale; they are carried as
`str` decoded from UTF-8 with `surrogateescape` (what `os.fsdecode`
gives on a UTF-8 system), so `os.fsencode` on the client side turns them
back into the original bytes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from hubserver.beneath import open_beneath
from hubserver.errors import FileChangedError, FileUnavailableError

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "cachefs-manifest"
MANIFEST_FORMAT_VERSION = 1

KIND_DIR = "d"
KIND_FILE = "f"
KIND_SYMLINK = "l"

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


@dataclass(frozen=True, slots=True)
class FileRecord:
    """What the hub needs to serve one regular file of the snapshot."""

    file_id: str
    version: str
    path: str  # relative to the root, '/'-separated, surrogateescape
    size_bytes: int
    mtime_ns: int
    ctime_ns: int  # any change of the file changes it, also one whose mtime was put back
    ino: int
    dev: int


_PACKED_RECORD = struct.Struct(">QQQQQ16s16s")  # id, version, size, inode, device, mtime, ctime; the path follows
_TIME_BYTES = 16  # nanoseconds need more than 64 bits after the year 2262 (ext4 goes to 2446)
_HEX16 = re.compile(r"[0-9a-f]{16}")


def _pack_record(record: FileRecord) -> bytes:
    head = _PACKED_RECORD.pack(
        int(record.file_id, 16), int(record.version, 16), record.size_bytes, record.ino, record.dev,
        record.mtime_ns.to_bytes(_TIME_BYTES, "big", signed=True), record.ctime_ns.to_bytes(_TIME_BYTES, "big", signed=True),
    )
    return head + _encode_path(record.path)


def _unpack_record(packed: bytes) -> FileRecord:
    file_id, version, size_bytes, ino, dev, mtime, ctime = _PACKED_RECORD.unpack_from(packed)
    path = _decode_path(packed[_PACKED_RECORD.size :])
    mtime_ns, ctime_ns = (int.from_bytes(time, "big", signed=True) for time in (mtime, ctime))
    return FileRecord(f"{file_id:016x}", f"{version:016x}", path, size_bytes, mtime_ns, ctime_ns, ino, dev)


class FileTable:
    """The snapshot's regular files by id, each packed into one bytes object.

    As objects (a FileRecord, its strings and ints, a dict slot) a file took
    ~500 bytes, ~640 MB for 1.28 M files; packed, ~200. A lookup unpacks a
    FileRecord (a few microseconds, once per request).
    """

    def __init__(self) -> None:
        self._packed: dict[int, bytes] = {}

    def add(self, record: FileRecord) -> FileRecord | None:
        """Add `record`; if another file has its id, leave that one and return it."""
        key = int(record.file_id, 16)
        first = self._packed.get(key)
        if first is not None:
            return _unpack_record(first)
        self._packed[key] = _pack_record(record)
        return None

    def get(self, file_id: str) -> FileRecord | None:
        """The file with id `file_id` (16 lowercase hex digits), None if there is none."""
        if not _HEX16.fullmatch(file_id):
            return None
        packed = self._packed.get(int(file_id, 16))
        return _unpack_record(packed) if packed is not None else None

    def values(self) -> Iterator[FileRecord]:
        for packed in self._packed.values():
            yield _unpack_record(packed)

    def __len__(self) -> int:
        return len(self._packed)


@dataclass(frozen=True, slots=True)
class Entry:
    """One manifest entry: a directory, a regular file or a symlink."""

    path: str  # relative to the root, '/'-separated; "" is the root
    kind: str  # KIND_DIR, KIND_FILE or KIND_SYMLINK
    mode: int  # st_mode & 0o7777
    mtime_ns: int
    size_bytes: int  # for a symlink: length of its target
    link_target: str | None = None  # symlinks only, never resolved
    file: FileRecord | None = None  # regular files only


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The scanned tree: its manifest, gzipped once, and its files indexed by id."""

    root: Path  # absolute, symlinks resolved
    manifest_gz: bytes  # the whole manifest, header first, as GET /v1/manifest sends it
    entry_count: int
    files_by_id: FileTable
    generation: str
    file_count: int
    total_bytes: int
    root_bytes: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root_bytes", os.fsencode(self.root))

    def abs_path(self, record: FileRecord) -> bytes:
        """Absolute path of a file of the snapshot, as bytes."""
        return self.root_bytes + b"/" + _encode_path(record.path)


def _decode_path(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _encode_path(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _xxh3_hex(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def file_id_for(rel_path: bytes) -> str:
    """The protocol's file id: xxh3_64 of the relative path bytes."""
    return _xxh3_hex(rel_path)


def version_for(st: os.stat_result) -> str:
    """The protocol's file version: changes with any change of the file."""
    key = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    return _xxh3_hex(key.encode("ascii"))


def _json_line(obj: dict[str, object]) -> bytes:
    """One compact NDJSON line.

    `ensure_ascii=True` writes lone surrogates (non-UTF-8 names) as
    `\\udcXX` escapes, which any JSON parser accepts and Python's
    `json.loads` turns back into the same `str`.
    """
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii") + b"\n"


def entry_line(entry: Entry) -> bytes:
    """The manifest line of one entry, newline included."""
    obj: dict[str, object] = {
        "p": entry.path,
        "k": entry.kind,
        "m": entry.mode,
        "t": entry.mtime_ns,
        "s": entry.size_bytes,
    }
    if entry.file is not None:
        obj["i"] = entry.file.file_id
        obj["v"] = entry.file.version
    if entry.link_target is not None:
        obj["l"] = entry.link_target
    return _json_line(obj)


def header_line(generation: str, entry_count: int) -> bytes:
    """The first manifest line: format, generation and entry count."""
    return _json_line(
        {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_FORMAT_VERSION,
            "generation": generation,
            "entries": entry_count,
        }
    )


_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03"  # deflate, no name, no mtime, Unix
_COMPRESS_BATCH_BYTES = 64 * 1024
_ZEROS = bytes(1 << 20)


class ManifestWriter:
    """Gzips the entry lines as the scan finds them; `finish` puts the header in front.

    The header holds the generation (a hash of every entry line) and the
    count, known only at the end, so the entries are compressed as a raw
    deflate stream of their own and the header as a deflate block before
    it; the gzip trailer's CRC-32 of header + entries is combined from the
    two (crc32 is affine in its start value). Scanning and serving then
    never hold the entries as objects, and a manifest request costs no CPU
    to compress (300,000 entries: 1.6 CPU-s per request before).
    """

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()
        self._compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._deflated: list[bytes] = []
        self._crc = 0
        self._length = 0
        self.entry_count = 0

    def add(self, line: bytes) -> None:
        self._hasher.update(line)
        self._crc = zlib.crc32(line, self._crc)
        self._length += len(line)
        self.entry_count += 1
        self._pending.append(line)
        self._pending_bytes += len(line)
        if self._pending_bytes >= _COMPRESS_BATCH_BYTES:
            self._deflated.append(self._compressor.compress(b"".join(self._pending)))
            self._pending.clear()
            self._pending_bytes = 0

    @property
    def generation(self) -> str:
        return self._hasher.hexdigest()

    def finish(self) -> bytes:
        """The gzipped manifest: header line, then every entry line added."""
        self._deflated.append(self._compressor.compress(b"".join(self._pending)))
        self._deflated.append(self._compressor.flush())
        header = header_line(self.generation, self.entry_count)
        head_compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
        head = head_compressor.compress(header) + head_compressor.flush(zlib.Z_SYNC_FLUSH)
        crc = self._crc ^ _crc32_of_zeros(self._length, zlib.crc32(header)) ^ _crc32_of_zeros(self._length, 0)
        trailer = struct.pack("<II", crc, (len(header) + self._length) & 0xFFFFFFFF)
        return b"".join([_GZIP_HEADER, head, *self._deflated, trailer])


def _crc32_of_zeros(length: int, start: int) -> int:
    """zlib.crc32 of `length` zero bytes, from `start`."""
    crc = start
    while length > 0:
        piece = min(length, len(_ZEROS))
        crc = zlib.crc32(memoryview(_ZEROS)[:piece], crc)
        length -= piece
    return crc


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _list_dir(dir_fd: int) -> list[os.DirEntry[str]]:
    """The entries of an open directory, sorted by name bytes; raises OSError."""
    with os.scandir(dir_fd) as it:
        return sorted(it, key=lambda child: os.fsencode(child.name))


@dataclass(slots=True)
class _Scanned:
    """One path found by the walk: relative path, lstat, and a symlink's target."""

    rel: bytes
    st: os.stat_result
    link_target: bytes | None = None


def _walk(root: bytes) -> Iterator[_Scanned]:
    """Yield every path in manifest order, the root first.

    Depth-first, names sorted by bytes, every directory before its children;
    symlinks are never followed. Each directory is opened relative to its
    parent's descriptor with O_NOFOLLOW and its children are looked at
    through it, so a directory swapped for a symlink during the scan is
    either skipped or still the directory that was opened: nothing outside
    the root is ever recorded. Unreadable directories are left out with a
    warning. Raises OSError only if the root itself cannot be opened or listed.
    """
    root_fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the root itself may be a symlink
    try:
        stack = [(b"", root_fd, iter(_list_dir(root_fd)))]
    except OSError:
        os.close(root_fd)
        raise
    try:
        yield _Scanned(b"", os.fstat(root_fd))
        while stack:
            prefix, dir_fd, children = stack[-1]
            child = next(children, None)
            if child is None:
                os.close(stack.pop()[1])
                continue
            scanned = _look_at(prefix, dir_fd, child)
            if scanned is None:
                continue
            if stat.S_ISDIR(scanned.st.st_mode):
                opened = _open_dir(dir_fd, child.name, scanned)
                if opened is None:
                    continue
                yield scanned
                stack.append((scanned.rel, *opened))
            else:
                yield scanned
    finally:
        for _prefix, dir_fd, _children in stack:
            os.close(dir_fd)


def _look_at(prefix: bytes, dir_fd: int, child: os.DirEntry[str]) -> _Scanned | None:
    """A child of an open directory: its lstat (and target, for a symlink); None for
    special files and what cannot be looked at."""
    name = os.fsencode(child.name)
    rel = name if not prefix else prefix + b"/" + name
    try:
        st = os.stat(child.name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        log.warning("skipping %r: cannot stat: %s", _decode_path(rel), exc.strerror)
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            return _Scanned(rel, st, os.fsencode(os.readlink(child.name, dir_fd=dir_fd)))
        except OSError as exc:
            log.warning("skipping symlink %r: cannot read it: %s", _decode_path(rel), exc.strerror)
            return None
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return _Scanned(rel, st)
    log.debug("skipping special file %r (mode %o)", _decode_path(rel), st.st_mode)
    return None


def _open_dir(dir_fd: int, name: str, scanned: _Scanned) -> tuple[int, Iterator[os.DirEntry[str]]] | None:
    """Open and list a subdirectory that was looked at, if it still is that directory."""
    rel = _decode_path(scanned.rel)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:  # ELOOP: swapped for a symlink since
        log.warning("skipping directory %r: cannot open: %s", rel, exc.strerror)
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (scanned.st.st_dev, scanned.st.st_ino):
            log.warning("skipping directory %r: replaced during the scan", rel)
            os.close(fd)
            return None
        scanned.st = st
        return fd, iter(_list_dir(fd))
    except OSError as exc:
        os.close(fd)
        log.warning("skipping directory %r: cannot list: %s", rel, exc.strerror)
        return None


def manifest_mtime(mtime_ns: int) -> int:
    """An mtime as the manifest gives it: clamped to what 64 bits of nanoseconds hold (years
    1677 to 2262); the hub keeps the exact one to tell a changed file."""
    return min(max(mtime_ns, -(1 << 63)), (1 << 63) - 1)


def _make_entry(scanned: _Scanned) -> Entry:
    """The manifest entry of one scanned path."""
    rel, st = scanned.rel, scanned.st
    path = _decode_path(rel)
    mode = stat.S_IMODE(st.st_mode)
    mtime_ns = manifest_mtime(st.st_mtime_ns)
    if stat.S_ISDIR(st.st_mode):
        return Entry(path, KIND_DIR, mode, mtime_ns, st.st_size)
    if scanned.link_target is not None:
        target = scanned.link_target
        return Entry(path, KIND_SYMLINK, mode, mtime_ns, len(target), link_target=_decode_path(target))
    record = FileRecord(
        file_id=file_id_for(rel),
        version=version_for(st),
        path=path,
        size_bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
        ctime_ns=st.st_ctime_ns,
        ino=st.st_ino,
        dev=st.st_dev,
    )
    return Entry(path, KIND_FILE, mode, mtime_ns, st.st_size, file=record)


def scan(root: Path) -> Snapshot:
    """Scan `root` into a snapshot. Blocking; raises OSError if the root
    itself cannot be read."""
    real_root = Path(os.path.realpath(root))
    root_bytes = os.fsencode(real_root)
    files_by_id = FileTable()
    manifest = ManifestWriter()
    total_bytes = 0
    for scanned in _walk(root_bytes):
        entry = _make_entry(scanned)
        record = entry.file
        if record is not None:
            first = files_by_id.add(record)
            if first is not None:
                log.error(
                    "file id collision: %r and %r both hash to %s; serving only the first",
                    first.path,
                    record.path,
                    record.file_id,
                )
                continue
            total_bytes += record.size_bytes
        manifest.add(entry_line(entry))
    return Snapshot(
        root=real_root,
        manifest_gz=manifest.finish(),
        entry_count=manifest.entry_count,
        files_by_id=files_by_id,
        generation=manifest.generation,
        file_count=len(files_by_id),
        total_bytes=total_bytes,
    )


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
    """True if the file on disk still is the one scanned: a regular file
    with the same size, mtime, ctime, device and inode. Raises
    FileUnavailableError if that cannot be told now. Blocking."""
    try:
        st = os.lstat(snapshot.abs_path(record))
    except OSError as exc:
        error = _open_error(record, exc)
        if isinstance(error, FileUnavailableError):
            raise error from None
        return False
    return _matches(record, st)


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
        fd = open_beneath(snapshot.root_bytes, _encode_path(record.path), _OPEN_FLAGS)
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
