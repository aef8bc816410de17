"""An open file's handle, with its read-ahead state, and the mount's table of open handles."""

from __future__ import annotations

import dataclasses

from ..namespace.tree import Inode


@dataclasses.dataclass
class OpenFile:
    """One open of a file (a FUSE file handle), and read-ahead's state for it."""

    inode: Inode
    pid: int = 0  # the process (thread) that opened it, from the FUSE request
    next_offset: int = 0
    sequential_reads: int = 0
    stream_start: int = 0  # offset where the current run of sequential reads began
    window_blocks: int = 0
    prefetched_until: int = 0  # first block not yet asked for by read-ahead
    next_file_asked: bool = False  # the window reached the end: the next file was looked for
    next_file: OpenFile | None = None  # that file, whose head the window runs on into
    closed: bool = False


class OpenFiles:
    """The open handles of the mount, by FUSE file handle (trio thread)."""

    def __init__(self) -> None:
        self._handles: dict[int, OpenFile] = {}
        self._next = 1

    def add(self, handle: OpenFile) -> int:
        fh = self._next
        self._next += 1
        self._handles[fh] = handle
        return fh

    def get(self, fh: int) -> OpenFile | None:
        return self._handles.get(fh)

    def pop(self, fh: int) -> OpenFile | None:
        return self._handles.pop(fh, None)

    def versions(self) -> set[tuple[bytes, bytes]]:
        """(file id, version) of every file open now: their cached blocks are kept."""
        return {(handle.inode.file_id, handle.inode.version) for handle in self._handles.values()}
