"""Inodes, names and attributes of the hub's snapshot, kept in LMDB.

The manifest is loaded once per generation in a single write transaction:
a crash or a broken download leaves the previous namespace intact. After
that, every metadata operation is a local LMDB read.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import logging
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeVar

import lmdb
import xxhash

from ..db import NamespaceDb
from ..errors import HubProtocolError
from ..fetch.hub_client import parse_json

log = logging.getLogger(__name__)

ROOT_INODE = 1
KIND_DIR, KIND_FILE, KIND_SYMLINK = 1, 2, 3
_KINDS = {"d": KIND_DIR, "f": KIND_FILE, "l": KIND_SYMLINK}

_ATTRS = struct.Struct(">BHqQQI")  # kind, mode, mtime_ns, size, parent inode, position in parent
_INO = struct.Struct(">Q")
# A file's record: _ATTRS, its 8-byte hub id, its 8-byte version (_pack_inode).
_FILE_ID, _VERSION = slice(_ATTRS.size, _ATTRS.size + 8), slice(_ATTRS.size + 8, _ATTRS.size + 16)
_POS = struct.Struct(">I")


@dataclasses.dataclass(frozen=True, slots=True)
class Inode:
    """One entry of the snapshot."""

    ino: int
    kind: int
    mode: int  # permission bits only
    mtime_ns: int
    size: int
    parent: int
    position: int = 0  # index among the parent's entries, in manifest order
    file_id: bytes = b""  # files: 8-byte hub id
    version: bytes = b""  # files: 8-byte content version
    target: bytes = b""  # symlinks: the link target

    @property
    def is_dir(self) -> bool:
        return self.kind == KIND_DIR

    @property
    def is_file(self) -> bool:
        return self.kind == KIND_FILE

    def block_count(self, block_size: int) -> int:
        """Blocks of `block_size` the file's bytes fill (the last one may be short)."""
        return -(-self.size // block_size)

    def block_length(self, blockno: int, block_size: int) -> int:
        """Bytes in block `blockno` (block_size, except for the last block)."""
        return block_length(self.size, blockno, block_size)


def block_length(size: int, blockno: int, block_size: int) -> int:
    """Bytes in block `blockno` of a file of `size` bytes (block_size, except for the last block)."""
    return min(block_size, size - blockno * block_size)


@dataclasses.dataclass(frozen=True, slots=True)
class ManifestSummary:
    generation: str
    entries: int
    file_bytes: int


def _pack_inode(inode: Inode) -> bytes:
    head = _ATTRS.pack(inode.kind, inode.mode, inode.mtime_ns, inode.size, inode.parent, inode.position)
    return head + inode.file_id + inode.version + inode.target


def _unpack_inode(ino: int, data: bytes) -> Inode:
    kind, mode, mtime_ns, size, parent, position = _ATTRS.unpack_from(data)
    if kind == KIND_FILE:
        return Inode(ino, kind, mode, mtime_ns, size, parent, position, data[_FILE_ID], data[_VERSION])
    return Inode(ino, kind, mode, mtime_ns, size, parent, position, target=bytes(data[_ATTRS.size :]))


class Namespace:
    """Read-side lookups over the loaded snapshot."""

    def __init__(self, db: NamespaceDb) -> None:
        self._db = db

    def get(self, ino: int) -> Inode | None:
        with self._db.env.begin(db=self._db.inodes) as txn:
            data = txn.get(_INO.pack(ino))
        return _unpack_inode(ino, data) if data is not None else None

    def inode_numbers(self) -> Iterator[int]:
        """Every inode number of the snapshot, read as they are used (no list of a million)."""
        with self._db.env.begin(db=self._db.inodes) as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                yield _INO.unpack(key)[0]

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        with self._db.env.begin() as txn:
            child = txn.get(_INO.pack(parent) + name, db=self._db.names)
            if child is None:
                return None
            ino = _INO.unpack(child)[0]
            data = txn.get(child, db=self._db.inodes)
        return _unpack_inode(ino, data) if data is not None else None

    def readdir(self, parent: int, start: int) -> Iterator[tuple[int, bytes, Inode]]:
        """(next position, name, inode) of a directory's entries from `start` on."""
        prefix = _INO.pack(parent)
        with self._db.env.begin() as txn:
            cursor = txn.cursor(db=self._db.dirents)
            if not cursor.set_range(prefix + _POS.pack(start)):
                return
            for key, value in cursor:
                if not key.startswith(prefix):
                    return
                position = _POS.unpack(key[8:])[0]
                ino = _INO.unpack(value[:8])[0]
                data = txn.get(value[:8], db=self._db.inodes)
                if data is not None:
                    yield position + 1, value[8:], _unpack_inode(ino, data)

    def file_version(self, file_id: bytes) -> bytes | None:
        """The version of the file with this hub id in the loaded snapshot (None if absent)."""
        inode = self._file(file_id)
        return inode.version if inode is not None else None

    def file_size(self, file_id: bytes) -> int | None:
        """The size of the file with this hub id in the loaded snapshot (None if absent)."""
        inode = self._file(file_id)
        return inode.size if inode is not None else None

    def _file(self, file_id: bytes) -> Inode | None:
        """The file with this hub id in the loaded snapshot (its inode number is its id)."""
        number = int.from_bytes(file_id, "big")
        inode = self.get(number if number > ROOT_INODE else number + 2)
        return inode if inode is not None and inode.is_file and inode.file_id == file_id else None

    def resolve(self, path: str) -> Inode | None:
        """The entry at a '/'-separated path relative to the root (no symlinks followed)."""
        inode = self.get(ROOT_INODE)
        for name in path.strip("/").split("/"):
            if inode is None or name in ("", "."):
                continue
            inode = self.lookup(inode.ino, os.fsencode(name)) if inode.is_dir else None
        return inode

    def walk_files(self, inode: Inode) -> Iterator[Inode]:
        """Every regular file at or below `inode`, depth first."""
        stack = [inode]
        while stack:
            entry = stack.pop()
            if entry.is_file:
                yield entry
            elif entry.is_dir:
                children = [child for _pos, _name, child in self.readdir(entry.ino, 0)]
                stack.extend(reversed(children))

    def top_level_name(self, file_id: bytes, directories: dict[int, str]) -> str | None:
        """The name of the top-level directory the file with this hub id lives under ('.' for
        a file in the root); None if the snapshot has no such file. `directories` (directory
        inode -> answer) remembers the directories walked through, for the next calls."""
        inode = self._file(file_id)
        if inode is None:
            return None
        if inode.parent == ROOT_INODE:
            return "."
        below: list[int] = []  # directories walked through, under the one answered
        node = inode.parent
        while node not in directories:
            directory = self.get(node)
            if directory is None:
                return None
            if directory.parent == ROOT_INODE:
                directories[node] = self._name_in_root(directory)
                break
            below.append(node)
            node = directory.parent
        for ino in below:
            directories[ino] = directories[node]
        return directories[node]

    def _name_in_root(self, directory: Inode) -> str:
        """The name of a top-level directory (its entry in the root, at its position)."""
        for _next, name, child in itertools.islice(self.readdir(ROOT_INODE, directory.position), 1):
            if child.ino == directory.ino:
                return os.fsdecode(name)
        return "?"

    def files_after(self, inode: Inode, count: int) -> list[Inode]:
        """Up to `count` files that follow `inode` in a depth-first walk of the tree.

        The rest of its directory, then the directories after it (and the
        ones after its parent...): the order a loader reading a sorted tree
        of small files goes in, across directory boundaries. At most
        4 x `count` entries are looked at.
        """
        found: list[Inode] = []
        budget = [4 * count]
        node = inode
        while len(found) < count and budget[0] > 0 and node.ino != ROOT_INODE:
            self._collect_files(node.parent, node.position + 1, count, found, budget)
            parent = self.get(node.parent)
            if parent is None:
                break
            node = parent
        return found

    def _collect_files(self, directory: int, start: int, count: int, found: list[Inode], budget: list[int]) -> None:
        """Files of `directory` from position `start` on, depth first, into `found`."""
        while len(found) < count and budget[0] > 0:
            # Read no more entries than could still be wanted (a read transaction
            # is not held across the recursion into a subdirectory).
            entries = list(itertools.islice(self.readdir(directory, start), min(budget[0], count - len(found))))
            if not entries:
                return
            for next_position, _name, child in entries:
                start = next_position
                budget[0] -= 1
                if child.is_file:
                    found.append(child)
                elif child.is_dir:
                    self._collect_files(child.ino, 0, count, found, budget)
                if len(found) >= count or budget[0] <= 0:
                    return

    def summary(self) -> ManifestSummary | None:
        with self._db.env.begin(db=self._db.meta) as txn:
            generation = txn.get(b"generation")
            if generation is None:
                return None
            entries = int(txn.get(b"entries", b"0"))
            file_bytes = int(txn.get(b"file_bytes", b"0"))
        return ManifestSummary(generation.decode(), entries, file_bytes)


_T_co = TypeVar("_T_co", covariant=True)


class Listing(Protocol[_T_co]):
    """A list, or records read one at a time from a file (namespace_loader.ChangesFile)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[_T_co]: ...


class Changes(Protocol):
    """What a new generation changed, for the kernel's caches to be told; `discard` once told."""

    @property
    def changed(self) -> Listing[int]: ...  # inodes whose attributes or content changed

    @property
    def removed(self) -> Listing[tuple[int, bytes, int]]: ...  # (parent, name, inode)

    @property
    def added(self) -> Listing[tuple[int, bytes]]: ...  # (parent, name), see NamespaceChanges

    @property
    def renewed(self) -> Listing[tuple[int, bytes]]: ...  # (parent, name), see NamespaceChanges

    def discard(self) -> None: ...


@dataclasses.dataclass
class NamespaceChanges:
    """What a new generation changed (Changes), as lists in memory."""

    changed: list[int] = dataclasses.field(default_factory=list)  # inodes whose attributes or content changed
    removed: list[tuple[int, bytes, int]] = dataclasses.field(default_factory=list)  # (parent, name, inode)
    # (parent, name) the kernel must look up again: new paths (it may hold a negative entry
    # for them) and paths whose kind changed (a file became a directory: a new kernel inode)
    added: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)
    # (parent, name) of files of a new version: with --nfs-export a new FUSE generation,
    # which only a lookup tells the kernel
    renewed: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)

    def discard(self) -> None:
        """Nothing to remove: the lists go with the object."""


def inode_number(path: str) -> int:
    """Stable inode numbers: a hash of the path, so they survive a new generation.

    For files this equals the hub's file id. 0 and 1 (the root) are avoided.
    """
    if path == "":
        return ROOT_INODE
    number = xxhash.xxh3_64_intdigest(os.fsencode(path))
    return number if number > ROOT_INODE else number + 2


def load_manifest(
    db: NamespaceDb,
    manifest_gz: Path,
    before_commit: Callable[[ManifestSummary, NamespaceChanges], None] | None = None,
) -> tuple[ManifestSummary, NamespaceChanges]:
    """Replace the namespace with the manifest in `manifest_gz` (one transaction).

    Returns the summary and what changed against the namespace it replaces;
    `before_commit` gets them first, inside the transaction (if it raises,
    nothing is loaded).
    The old namespace is compared in LMDB, not copied into memory: the
    daemon's memory does not grow with the number of entries (only with the
    changes listed, and the number of directories).
    """
    with gzip.open(manifest_gz, "rb") as stream:
        lines = (parse_json(line) for line in stream if line.strip())
        try:
            header = next(lines)
        except StopIteration:
            raise HubProtocolError("the hub's manifest is empty") from None
        _check_header(header)
        with db.env.begin(write=True) as txn:
            # The old entries (dirents) stay: a name both generations have keeps its position, so a
            # readdir that resumes at an offset of the old generation neither skips nor repeats it.
            txn.drop(db.loading, delete=False)
            entries, file_bytes, changes = _write_entries(txn, db, lines)
            _drop_old_names(txn, db, changes)
            txn.drop(db.loading, delete=False)
            txn.put(b"generation", str(header["generation"]).encode(), db=db.meta)
            txn.put(b"entries", str(entries).encode(), db=db.meta)
            txn.put(b"file_bytes", str(file_bytes).encode(), db=db.meta)
            summary = ManifestSummary(str(header["generation"]), entries, file_bytes)
            if before_commit is not None:
                before_commit(summary, changes)
    log.info("loaded manifest generation %s: %d entries, %d file bytes", header["generation"], entries, file_bytes)
    return summary, changes


def _drop_old_names(txn: lmdb.Transaction, db: NamespaceDb, changes: NamespaceChanges) -> None:
    """Remove the names (and inodes) of the old namespace that the manifest loaded has not
    (its entries are in `db.loading`; a name it has was overwritten with the same inode)."""
    cursor = txn.cursor(db=db.names)
    cursor.first()
    while key := cursor.key():  # empty once past the last name
        packed_ino = cursor.value()
        if txn.get(packed_ino, db=db.loading) is not None:
            cursor.next()
            continue
        changes.removed.append((_INO.unpack(key[:8])[0], bytes(key[8:]), _INO.unpack(packed_ino)[0]))
        old = txn.get(packed_ino, db=db.inodes)
        if old is not None:
            txn.delete(bytes(key[:8]) + _POS.pack(_ATTRS.unpack_from(old)[5]), db=db.dirents)
        txn.delete(packed_ino, db=db.inodes)
        cursor.delete()  # and on to the next name


def _check_header(header: dict[str, Any]) -> None:
    if header.get("format") != "cachefs-manifest" or header.get("format_version") != 1:
        raise HubProtocolError(f"unsupported manifest format: {str(header)[:120]}")
    if not isinstance(header.get("generation"), str):
        raise HubProtocolError("manifest header has no generation")


def _write_entries(txn: lmdb.Transaction, db: NamespaceDb, lines: Iterator[dict[str, Any]]) -> tuple[int, int, NamespaceChanges]:
    """Write every entry (and note it in `db.loading`); parents always come before children in a manifest.

    Into an empty namespace (the first load) nothing is listed as added: the
    kernel knows no name yet, and a large dataset's list would be large."""
    next_position: dict[int, int] = {}  # per directory
    first_load = txn.stat(db.inodes)["entries"] == 0
    changes = NamespaceChanges()
    entries = file_bytes = 0
    for entry in lines:
        try:
            path, inode = entry["p"], _entry_to_inode(entry)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(Infinity)
            raise HubProtocolError(f"malformed manifest entry {str(entry)[:120]}: {exc!r}") from None
        if entries == 0 and (path != "" or not inode.is_dir):
            raise HubProtocolError("manifest does not start with the root directory")
        packed_ino = _INO.pack(inode.ino)
        if not txn.put(packed_ino, b"", overwrite=False, db=db.loading) or (
            path != "" and txn.get(_INO.pack(inode.parent), db=db.loading) is None
        ):
            raise HubProtocolError(f"manifest entry {path!r} is duplicated or comes before its directory")
        name = b""
        old = txn.get(packed_ino, db=db.inodes)
        if path != "":
            name = os.fsencode(path.rpartition("/")[2])
            key = _INO.pack(inode.parent)
            if old is not None:  # the same path (inode numbers are path hashes): the same position
                position = _ATTRS.unpack_from(old)[5]
            else:  # a new name: after every position the directory had
                if inode.parent not in next_position:
                    next_position[inode.parent] = _after_last_position(txn, db, key)
                position = next_position[inode.parent]
                next_position[inode.parent] = position + 1
            inode = dataclasses.replace(inode, position=position)
            txn.put(key + name, packed_ino, db=db.names)
            txn.put(key + _POS.pack(position), packed_ino + name, db=db.dirents)
        packed = _pack_inode(inode)
        if old is not None and _without_position(old) != _without_position(packed):
            changes.changed.append(inode.ino)
        if path != "" and not first_load:
            if old is None or _ATTRS.unpack_from(old)[0] != inode.kind:
                changes.added.append((inode.parent, name))
            elif inode.is_file and old[_VERSION] != inode.version:
                changes.renewed.append((inode.parent, name))
        txn.put(packed_ino, packed, db=db.inodes)
        file_bytes += inode.size if inode.is_file else 0
        entries += 1
    if entries == 0:
        raise HubProtocolError("manifest has no root entry")
    return entries, file_bytes, changes


def _after_last_position(txn: lmdb.Transaction, db: NamespaceDb, prefix: bytes) -> int:
    """The position after the last entry the directory `prefix` (its packed inode) has in `db.dirents`."""
    cursor = txn.cursor(db=db.dirents)
    if cursor.set_range(prefix + b"\xff" * _POS.size):
        if bytes(cursor.key()).startswith(prefix):  # the position 0xffffffff itself
            raise HubProtocolError("a directory's positions are exhausted")
        found = cursor.prev()
    else:
        found = cursor.last()
    last = bytes(cursor.key())
    if not found or not last.startswith(prefix):
        return 0
    return int(_POS.unpack(last[8:])[0]) + 1


def _without_position(packed: bytes | memoryview) -> bytes:
    """An inode record minus its directory position (a reorder is no change)."""
    position_at = _ATTRS.size - _POS.size
    return b"".join((packed[:position_at], packed[_ATTRS.size :]))


class _InodeCommon(TypedDict):
    """The fields every kind of entry has."""

    ino: int
    kind: int
    mode: int
    mtime_ns: int
    parent: int


def _entry_to_inode(entry: dict[str, Any]) -> Inode:
    path: str = entry["p"]
    if not isinstance(path, str) or path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise ValueError("invalid path")
    kind = _KINDS[entry["k"]]
    parent = ROOT_INODE if path == "" else inode_number(path.rpartition("/")[0])
    mtime_ns = _in_range(entry["t"], -(1 << 63), 1 << 63)
    common = _InodeCommon(
        ino=inode_number(path), kind=kind, mode=int(entry["m"]) & 0o7777, mtime_ns=mtime_ns, parent=parent
    )
    if kind == KIND_FILE:
        file_id, version = bytes.fromhex(entry["i"]), bytes.fromhex(entry["v"])
        if len(file_id) != 8 or len(version) != 8:
            raise ValueError("file id and version must be 16 hex digits")
        if int.from_bytes(file_id, "big") != xxhash.xxh3_64_intdigest(os.fsencode(path)):
            raise ValueError("file id does not match the path")
        return Inode(size=_in_range(entry["s"], 0, 1 << 63), file_id=file_id, version=version, **common)
    if kind == KIND_SYMLINK:
        target = os.fsencode(entry["l"])
        return Inode(size=len(target), target=target, **common)
    return Inode(size=0, **common)


def _in_range(value: Any, low: int, high: int) -> int:
    """An integer of the manifest that must fit its field: low <= value < high (else ValueError)."""
    number = int(value)
    if not low <= number < high:
        raise ValueError(f"{number} is out of range")
    return number
