"""The `plan` command's wire format: a loader's plan received line by line over the control socket, checked as it comes."""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable
from typing import Any

import trio

from ..control.server import Lines
from ..errors import CachefsError
from ..namespace.tree import KIND_SYMLINK, Inode, Namespace
from .plans import Plan

# Plan lines carry up to a few thousand reads; a line that long is no plan.
MAX_LINE_BYTES = 8 << 20
# Block uses one plan may hold: 8 bytes each in the cache dir's plans/ beyond the first
# 512 K, so at most 1 GiB there (a shuffled epoch of 16 KiB samples over 2 TiB of data).
MAX_PLAN_USES = 1 << 27
# Block uses added between two looks at the event loop's other work: about a millisecond.
USES_PER_CHECKPOINT = 4096
# Symlinks followed in a row from a plan's file to the file it reads (the kernel's limit).
MAX_SYMLINK_HOPS = 40
# While a plan is being sent, the longest pause between two of its lines.
LINE_TIMEOUT_S = 120.0


async def receive_plan(plan: Plan, lines: Lines, namespace: Namespace, arrived: Callable[[], None]) -> bool:
    """Read the plan's lines up to its end marker, calling `arrived` after each; False if the client
    closed the connection first. Raises CachefsError (the plan is rejected) on a bad line."""
    directories: dict[str, Inode | None] = {}
    summary = namespace.summary()
    max_files = summary.entries if summary is not None else 0  # a table longer lists some file twice
    while True:
        try:
            with trio.fail_after(LINE_TIMEOUT_S):
                line = await lines.receive_line(MAX_LINE_BYTES)
        except trio.TooSlowError:
            raise CachefsError(f"plan rejected: no line for {LINE_TIMEOUT_S:g} s before its end marker") from None
        if line is None:
            return False
        _stop_if_cancelled(plan)
        try:
            message = json.loads(line)
        except ValueError:
            raise CachefsError("malformed plan line: not JSON") from None
        if not isinstance(message, dict):
            raise CachefsError("malformed plan line: expected an object")
        if message.get("end"):
            return True
        if "files" in message:
            await _add_files(plan, namespace, message["files"], directories, max_files)
        if "reads" in message:
            await _add_reads(plan, message["reads"])
        arrived()
        await trio.lowlevel.checkpoint()


async def _add_files(plan: Plan, namespace: Namespace, paths: Any, directories: dict[str, Inode | None],
                     max_files: int) -> None:
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise CachefsError("malformed plan line: files must be a list of paths")
    if len(plan.files) + len(paths) > max_files:
        raise CachefsError(f"plan rejected: its file table is longer than the snapshot's {max_files} entries; "
                           "list each file once")
    for number, path in enumerate(paths, 1):
        if number % USES_PER_CHECKPOINT == 0:
            await _checkpoint(plan)
        parent_path, _slash, name = path.strip("/").rpartition("/")
        if parent_path not in directories:  # a dataset of many files has few directories
            directories[parent_path] = namespace.resolve(parent_path)
        parent = directories[parent_path]
        inode = None
        if parent is not None and parent.is_dir:
            inode = namespace.lookup(parent.ino, os.fsencode(name)) if name not in ("", ".") else parent
        if inode is not None and inode.kind == KIND_SYMLINK:
            inode = _followed(namespace, path.strip("/"), inode)
        if inode is None:
            raise CachefsError(f"plan rejected: no such file in the mounted snapshot: {path or '/'}")
        if not inode.is_file:
            raise CachefsError(f"plan rejected: not a regular file: {path or '/'}")
        plan.add_file(inode)


def _followed(namespace: Namespace, path: str, link: Inode) -> Inode | None:
    """The entry a symlink at `path` leads to within the snapshot (datasets of links to blobs,
    as Hugging Face caches lay them out), as reading through the mount finds it; only
    relative targets, which stay inside the mount wherever it is mounted."""
    inode: Inode | None = link
    for _hop in range(MAX_SYMLINK_HOPS):
        if inode is None or inode.kind != KIND_SYMLINK:
            return inode
        target = os.fsdecode(inode.target)
        path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
        if target.startswith("/") or path == ".." or path.startswith("../"):
            raise CachefsError(f"plan rejected: a symlink leads out of the snapshot: {target}")
        inode = namespace.resolve(path)
    raise CachefsError(f"plan rejected: more than {MAX_SYMLINK_HOPS} symlinks in a row: {path}")


async def _add_reads(plan: Plan, reads: Any) -> None:
    """Validate and add reads [file index, offset, length or null], letting the event loop
    serve other work between every USES_PER_CHECKPOINT block uses added."""
    if not isinstance(reads, list):
        raise CachefsError("malformed plan line: reads must be a list")
    sizes = plan.files.sizes
    checkpoint_at = plan.store.length + USES_PER_CHECKPOINT
    piece_bytes = USES_PER_CHECKPOINT * plan.block_size  # a read of a whole large file is many pieces
    for read in reads:
        if not isinstance(read, list) or len(read) != 3:
            raise CachefsError("malformed plan read: expected [file, offset, length]")
        index, offset, length = read
        if not isinstance(index, int) or not 0 <= index < len(sizes):
            raise CachefsError(f"malformed plan read: unknown file index {index!r}")
        if not isinstance(offset, int) or offset < 0:
            raise CachefsError(f"malformed plan read: bad offset {offset!r}")
        size = sizes[index]
        if length is None:
            length = size - offset
        elif not isinstance(length, int) or length < 0:
            raise CachefsError(f"malformed plan read: bad length {length!r}")
        length = min(length, size - offset)
        if length <= 0:
            if offset > size:
                raise CachefsError(f"plan rejected: offset {offset} is beyond the end of a {size}-byte file "
                                   f"(file {index} of the plan)")
            continue
        start, end = offset, offset + length
        while start < end:
            stop = min(end, (start // piece_bytes + 1) * piece_bytes)
            plan.add_read(index, start, stop - start, counted=start == offset)
            start = stop
            if plan.store.length >= checkpoint_at:
                if plan.store.length > MAX_PLAN_USES:
                    raise CachefsError(f"plan rejected: more than {MAX_PLAN_USES} block uses; "
                                       "send one epoch's plan at a time")
                await _checkpoint(plan)
                checkpoint_at = plan.store.length + USES_PER_CHECKPOINT


async def _checkpoint(plan: Plan) -> None:
    """Let the event loop run other work; the plan may have been cancelled meanwhile."""
    await trio.lowlevel.checkpoint()
    _stop_if_cancelled(plan)


def _stop_if_cancelled(plan: Plan) -> None:
    if plan.cancelled:  # cancel_all while it was being sent: its entry store is closed
        raise CachefsError("plan cancelled while it was being sent: the mount moved to a new snapshot; send it again")


async def cancel_when_closed(lines: Lines, scope: trio.CancelScope) -> None:
    """Wait for the client to close the connection (or send {"cancel": true}), then cancel `scope`."""
    while True:
        line = await lines.receive_line(MAX_LINE_BYTES)
        if line is None:
            break
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("cancel"):
            break
    scope.cancel()
