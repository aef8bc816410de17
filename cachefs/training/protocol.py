"""The `plan` command's wire format: a loader's plan received line by line over the control socket, checked as it comes."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import trio

from ..control.server import Lines
from ..errors import CachefsError
from ..namespace.tree import Inode, Namespace
from .plans import Plan

# Plan lines carry up to a few thousand reads; a line that long is no plan.
MAX_LINE_BYTES = 8 << 20
# While a plan is being sent, the longest pause between two of its lines.
LINE_TIMEOUT_S = 120.0


async def receive_plan(plan: Plan, lines: Lines, namespace: Namespace, arrived: Callable[[], None]) -> bool:
    """Read the plan's lines up to its end marker, calling `arrived` after each; False if the client
    closed the connection first. Raises CachefsError (the plan is rejected) on a bad line."""
    directories: dict[str, Inode | None] = {}
    while True:
        try:
            with trio.fail_after(LINE_TIMEOUT_S):
                line = await lines.receive_line(MAX_LINE_BYTES)
        except trio.TooSlowError:
            raise CachefsError(f"plan rejected: no line for {LINE_TIMEOUT_S:g} s before its end marker") from None
        if line is None:
            return False
        if plan.cancelled:  # cancel_all while it was being sent: its entry store is closed
            raise CachefsError("plan cancelled while it was being sent: the mount moved to a new snapshot; "
                               "send it again")
        try:
            message = json.loads(line)
        except ValueError:
            raise CachefsError("malformed plan line: not JSON") from None
        if not isinstance(message, dict):
            raise CachefsError("malformed plan line: expected an object")
        if message.get("end"):
            return True
        if "files" in message:
            _add_files(plan, namespace, message["files"], directories)
        if "reads" in message:
            _add_reads(plan, message["reads"])
        arrived()
        await trio.lowlevel.checkpoint()

def _add_files(plan: Plan, namespace: Namespace, paths: Any, directories: dict[str, Inode | None]) -> None:
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise CachefsError("malformed plan line: files must be a list of paths")
    for path in paths:
        parent_path, _slash, name = path.strip("/").rpartition("/")
        if parent_path not in directories:  # a dataset of many files has few directories
            directories[parent_path] = namespace.resolve(parent_path)
        parent = directories[parent_path]
        inode = None
        if parent is not None and parent.is_dir:
            inode = namespace.lookup(parent.ino, os.fsencode(name)) if name not in ("", ".") else parent
        if inode is None:
            raise CachefsError(f"plan rejected: no such file in the mounted snapshot: {path or '/'}")
        if not inode.is_file:
            raise CachefsError(f"plan rejected: not a regular file: {path or '/'}")
        plan.add_file(inode)


def _add_reads(plan: Plan, reads: Any) -> None:
    """Validate and add reads [file index, offset, length or null]."""
    if not isinstance(reads, list):
        raise CachefsError("malformed plan line: reads must be a list")
    sizes = plan.files.sizes
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
        if length > 0:
            plan.add_read(index, offset, length)
        elif offset > size:
            raise CachefsError(f"plan rejected: offset {offset} is beyond the end of a {size}-byte file "
                               f"(file {index} of the plan)")


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
