"""What a snapshot holds: its gzipped manifest, and a compact table of its files by id.

Paths are handled as bytes while scanning, so the result does not depend on
the locale; they are carried as `str` decoded from UTF-8 with
`surrogateescape` (what `os.fsdecode` gives on a UTF-8 system), so
`os.fsencode` on the client side turns them back into the original bytes.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash


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
    return head + encode_path(record.path)


def _unpack_record(packed: bytes) -> FileRecord:
    file_id, version, size_bytes, ino, dev, mtime, ctime = _PACKED_RECORD.unpack_from(packed)
    path = decode_path(packed[_PACKED_RECORD.size :])
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
        return self.root_bytes + b"/" + encode_path(record.path)


def decode_path(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def encode_path(text: str) -> bytes:
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
