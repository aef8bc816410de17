"""Load a manifest into the namespace in a short-lived child process.

LMDB keeps the pages a write transaction dirtied in the writing process's
heap, and keeps them for reuse after the commit: loading a manifest of
1.28 M entries in the daemon would leave ~250 MB of anonymous memory in it
for good (~200 bytes per entry). A child process opens the same LMDB
environment (LMDB is multi-process safe: one writer at a time, readers see
the commit atomically), runs `namespace.load_manifest` and exits, and that
memory goes with it. The daemon carries on meanwhile: its namespace readers
see the old snapshot until the commit, and the block index, in its own
environment, takes fetched blocks without waiting for the load's write lock.

What the load changed is written inside the load's transaction, before
its commit: the changes in a binary file (records the daemon reads one at a
time while it tells the kernel: a refresh that renames every directory of
a million files would otherwise be a million names in its memory), then a
JSON answer (summary, and where each list starts in the file and how long
it is), renamed into place. A child that dies after committing (the OOM
killer) still leaves the daemon what to tell the kernel, and a child that
dies before never leaves an answer for a generation the namespace shows.
On stdout the child says "started" once it runs, then either "ok" or the
error as JSON.

    python -m cachefs.namespace.loader NAMESPACE_DIR MANIFEST_GZ ANSWER_JSON
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Generic, TypeVar

import lmdb
import trio

from ..db import open_namespace_db
from ..errors import CachefsError, HubProtocolError
from .tree import ManifestSummary, NamespaceChanges, load_manifest

log = logging.getLogger(__name__)


class ChildFailed(CachefsError):
    """The child process could not run the load (it could not start, or died before starting it)."""


async def load_in_child(
    namespace_dir: Path, manifest_gz: Path, stored_generation: Callable[[], str | None]
) -> tuple[ManifestSummary, ChangesFile]:
    """`load_manifest` on the environment at `namespace_dir`, in a child process.

    `stored_generation` reads the generation the namespace shows (the daemon's
    own environment). The changes are read from a file next to `manifest_gz`
    until their `discard`. Raises HubProtocolError for a malformed manifest,
    CachefsError if it was not loaded, ChildFailed if the child could not run.
    """
    answer_path = manifest_gz.with_name(manifest_gz.name + ".loaded.json")
    changes_path = _changes_path(answer_path)
    answer_path.unlink(missing_ok=True)
    changes_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", __name__, str(namespace_dir), str(manifest_gz), str(answer_path)]
    try:
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    except OSError as exc:  # no such interpreter, not executable, ...
        raise ChildFailed(f"the manifest loader ({sys.executable} -m {__name__}) cannot run: {exc}") from None
    try:
        loaded = _read_answer(answer_path, changes_path, stored_generation)
    finally:
        answer_path.unlink(missing_ok=True)
    if loaded is not None:
        summary, changes = loaded
        log.info("loaded manifest generation %s: %d entries, %d file bytes", summary.generation, summary.entries,
                 summary.file_bytes)
        return summary, changes
    changes_path.unlink(missing_ok=True)
    lines = result.stdout.splitlines()
    if lines[-1:] and lines[-1].startswith(b"{"):
        report = json.loads(lines[-1])
        if "error" in report:
            raise (HubProtocolError if report.get("kind") == "protocol" else CachefsError)(report["error"])
    detail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
    if b"started" not in lines:
        raise ChildFailed(f"the manifest loader ({sys.executable} -m {__name__}) failed: {detail[0]}")
    raise CachefsError(f"the manifest loader died before loading anything ({detail[0]})")


def _read_answer(
    answer_path: Path, changes_path: Path, stored_generation: Callable[[], str | None]
) -> tuple[ManifestSummary, ChangesFile] | None:
    """The child's answer if its load was committed (the namespace shows its generation)."""
    try:
        answer = json.loads(answer_path.read_bytes())
    except (FileNotFoundError, ValueError):  # none, or cut short: the child died before the commit
        return None
    summary = ManifestSummary(**answer["summary"])
    if stored_generation() != summary.generation:
        return None  # written, but the child died before the commit
    return summary, ChangesFile(changes_path, answer["changes"])


def _changes_path(answer_path: Path) -> Path:
    """The binary file of the changes, written before the answer that points into it."""
    return answer_path.with_suffix(".changes")


_CHANGED = struct.Struct(">Q")  # inode
_REMOVED = struct.Struct(">QQI")  # parent, inode, name length; the name follows
_ADDED = struct.Struct(">QI")  # parent, name length; the name follows


def _write_changes(path: Path, changes: NamespaceChanges) -> dict[str, tuple[int, int]]:
    """Write the four lists; returns each one's (offset, count)."""
    sections = {}
    with open(path, "wb") as out:
        sections["changed"] = (out.tell(), len(changes.changed))
        for ino in changes.changed:
            out.write(_CHANGED.pack(ino))
        sections["removed"] = (out.tell(), len(changes.removed))
        for parent, name, ino in changes.removed:
            out.write(_REMOVED.pack(parent, ino, len(name)) + name)
        for section, names in (("added", changes.added), ("renewed", changes.renewed)):
            sections[section] = (out.tell(), len(names))
            for parent, name in names:
                out.write(_ADDED.pack(parent, len(name)) + name)
    return sections


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise CachefsError(f"the manifest loader's list of changes ({stream.name}) is cut short")
    return data


def _read_changed(stream: BinaryIO) -> int:
    ino: int = _CHANGED.unpack(_read_exactly(stream, _CHANGED.size))[0]
    return ino


def _read_removed(stream: BinaryIO) -> tuple[int, bytes, int]:
    parent, ino, length = _REMOVED.unpack(_read_exactly(stream, _REMOVED.size))
    return parent, _read_exactly(stream, length), ino


def _read_added(stream: BinaryIO) -> tuple[int, bytes]:
    parent, length = _ADDED.unpack(_read_exactly(stream, _ADDED.size))
    return parent, _read_exactly(stream, length)


_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class _Records(Generic[_T]):
    """One list of the changes file, read a record at a time each time it is iterated."""

    path: Path
    offset: int
    count: int
    read_one: Callable[[BinaryIO], _T]

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[_T]:
        with open(self.path, "rb") as stream:
            stream.seek(self.offset)
            for _ in range(self.count):
                yield self.read_one(stream)


def _records(path: Path, section: list[int], read_one: Callable[[BinaryIO], _T]) -> _Records[_T]:
    offset, count = section
    return _Records(path, offset, count, read_one)


class ChangesFile:
    """What a child's load changed (namespace.Changes), in the file it wrote; `discard` removes it."""

    def __init__(self, path: Path, sections: dict[str, list[int]]) -> None:
        self._path = path
        self.changed = _records(path, sections["changed"], _read_changed)
        self.removed = _records(path, sections["removed"], _read_removed)
        self.added = _records(path, sections["added"], _read_added)
        self.renewed = _records(path, sections["renewed"], _read_added)

    def discard(self) -> None:
        self._path.unlink(missing_ok=True)


def _load(namespace_dir: Path, manifest_gz: Path, answer_path: Path) -> dict[str, Any]:
    """The child's work: the load, its answer written before the commit. Returns what to print."""

    def write_answer(summary: ManifestSummary, changes: NamespaceChanges) -> None:
        sections = _write_changes(_changes_path(answer_path), changes)
        answer = {"summary": dataclasses.asdict(summary), "changes": sections}
        partial = answer_path.with_name(answer_path.name + ".part")
        partial.write_text(json.dumps(answer))
        os.replace(partial, answer_path)

    db = None
    try:
        db = open_namespace_db(namespace_dir)
        load_manifest(db, manifest_gz, before_commit=write_answer)
    except HubProtocolError as exc:
        return {"error": str(exc), "kind": "protocol"}
    except (OSError, lmdb.Error) as exc:
        return {"error": f"cannot load the hub's manifest into {namespace_dir.parent}: {exc}", "kind": "storage"}
    finally:
        if db is not None:
            try:
                db.close()
            except (OSError, lmdb.Error) as exc:  # after the commit: the load stands
                log.warning("closing the namespace after loading: %s", exc)
    return {"ok": True}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m cachefs.namespace.loader NAMESPACE_DIR MANIFEST_GZ ANSWER_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    print("started", flush=True)
    print(json.dumps(_load(Path(argv[0]), Path(argv[1]), Path(argv[2]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
