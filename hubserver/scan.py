"""Scanning the root into a snapshot: a walk in manifest order that never follows a symlink.

A snapshot is taken at start, and again at each rescan (rescan.py).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hubserver.manifest import KIND_DIR, KIND_FILE, KIND_SYMLINK, Entry, ManifestWriter, entry_line, manifest_mtime
from hubserver.snapshot import FileRecord, FileTable, Snapshot, decode_path, file_id_for, version_for

log = logging.getLogger(__name__)

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
        log.warning("skipping %r: cannot stat: %s", decode_path(rel), exc.strerror)
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            return _Scanned(rel, st, os.fsencode(os.readlink(child.name, dir_fd=dir_fd)))
        except OSError as exc:
            log.warning("skipping symlink %r: cannot read it: %s", decode_path(rel), exc.strerror)
            return None
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return _Scanned(rel, st)
    log.debug("skipping special file %r (mode %o)", decode_path(rel), st.st_mode)
    return None


def _open_dir(dir_fd: int, name: str, scanned: _Scanned) -> tuple[int, Iterator[os.DirEntry[str]]] | None:
    """Open and list a subdirectory that was looked at, if it still is that directory."""
    rel = decode_path(scanned.rel)
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


def _make_entry(scanned: _Scanned) -> Entry:
    """The manifest entry of one scanned path."""
    rel, st = scanned.rel, scanned.st
    path = decode_path(rel)
    mode = stat.S_IMODE(st.st_mode)
    mtime_ns = manifest_mtime(st.st_mtime_ns)
    if stat.S_ISDIR(st.st_mode):
        return Entry(path, KIND_DIR, mode, mtime_ns, st.st_size)
    if scanned.link_target is not None:
        target = scanned.link_target
        return Entry(path, KIND_SYMLINK, mode, mtime_ns, len(target), link_target=decode_path(target))
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
