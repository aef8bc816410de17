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

What the load changed is written to an answer file inside the load's
transaction, before its commit: a child that dies after committing (the
OOM killer) still leaves the daemon what to tell the kernel, and a child
that dies before never leaves an answer for a generation the namespace
shows. On stdout the child says "started" once it runs, then either "ok"
or the error as JSON.

    python -m cachefs.namespace_loader NAMESPACE_DIR MANIFEST_GZ ANSWER_JSON
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import trio

from .db import open_namespace_db
from .errors import CachefsError, HubProtocolError
from .namespace import ManifestSummary, NamespaceChanges, load_manifest

log = logging.getLogger(__name__)


class ChildFailed(CachefsError):
    """The child process could not run the load (it could not start, or died before starting it)."""


async def load_in_child(
    namespace_dir: Path, manifest_gz: Path, stored_generation: Callable[[], str | None]
) -> tuple[ManifestSummary, NamespaceChanges]:
    """`load_manifest` on the environment at `namespace_dir`, in a child process.

    `stored_generation` reads the generation the namespace shows (the daemon's
    own environment). Raises HubProtocolError for a malformed manifest,
    CachefsError if it was not loaded, ChildFailed if the child could not run.
    """
    answer_path = manifest_gz.with_name(manifest_gz.name + ".loaded.json")
    answer_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", __name__, str(namespace_dir), str(manifest_gz), str(answer_path)]
    try:
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    except OSError as exc:  # no such interpreter, not executable, ...
        raise ChildFailed(f"the manifest loader ({sys.executable} -m {__name__}) cannot run: {exc}") from None
    try:
        loaded = _read_answer(answer_path, stored_generation)
    finally:
        answer_path.unlink(missing_ok=True)
    if loaded is not None:
        summary, changes = loaded
        log.info("loaded manifest generation %s: %d entries, %d file bytes", summary.generation, summary.entries,
                 summary.file_bytes)
        return summary, changes
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
    answer_path: Path, stored_generation: Callable[[], str | None]
) -> tuple[ManifestSummary, NamespaceChanges] | None:
    """The child's answer if its load was committed (the namespace shows its generation)."""
    try:
        answer = json.loads(answer_path.read_bytes())
    except (FileNotFoundError, ValueError):  # none, or cut short: the child died before the commit
        return None
    summary = ManifestSummary(**answer["summary"])
    if stored_generation() != summary.generation:
        return None  # written, but the child died before the commit
    return summary, _changes_from_json(answer["changes"])


def _changes_to_json(changes: NamespaceChanges) -> dict[str, Any]:
    """Names are bytes (any, not only UTF-8): sent as latin-1 text, which maps every byte."""
    return {
        "changed": changes.changed,
        "removed": [[parent, name.decode("latin-1"), ino] for parent, name, ino in changes.removed],
        "added": [[parent, name.decode("latin-1")] for parent, name in changes.added],
    }


def _changes_from_json(data: dict[str, Any]) -> NamespaceChanges:
    return NamespaceChanges(
        changed=list(data["changed"]),
        removed=[(parent, name.encode("latin-1"), ino) for parent, name, ino in data["removed"]],
        added=[(parent, name.encode("latin-1")) for parent, name in data["added"]],
    )


def _load(namespace_dir: Path, manifest_gz: Path, answer_path: Path) -> dict[str, Any]:
    """The child's work: the load, its answer written before the commit. Returns what to print."""

    def write_answer(summary: ManifestSummary, changes: NamespaceChanges) -> None:
        answer = {"summary": dataclasses.asdict(summary), "changes": _changes_to_json(changes)}
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
        print("usage: python -m cachefs.namespace_loader NAMESPACE_DIR MANIFEST_GZ ANSWER_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    print("started", flush=True)
    print(json.dumps(_load(Path(argv[0]), Path(argv[1]), Path(argv[2]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
