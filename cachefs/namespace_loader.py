"""Load a manifest into the namespace in a short-lived child process.

LMDB keeps the pages a write transaction dirtied in the writing process's
heap, and keeps them for reuse after the commit: loading a manifest of
1.28 M entries in the daemon would leave ~250 MB of anonymous memory in it
for good (~200 bytes per entry). A child process opens the same LMDB
environment (LMDB is multi-process safe: one writer at a time, readers see
the commit atomically), runs `namespace.load_manifest` and exits, and that
memory goes with it. The daemon's readers and writers carry on meanwhile
(its writers wait for the write lock, as they did for a load in a thread).

The child prints one JSON object on stdout: the summary and the changes,
or the error.

    python -m cachefs.namespace_loader INDEX_DIR MANIFEST_GZ
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import lmdb
import trio

from .db import open_database
from .errors import CachefsError, HubProtocolError
from .namespace import ManifestSummary, NamespaceChanges, load_manifest

log = logging.getLogger(__name__)


class ChildFailed(CachefsError):
    """The child process gave no answer (it could not start, or died)."""


async def load_in_child(index_dir: Path, manifest_gz: Path) -> tuple[ManifestSummary, NamespaceChanges]:
    """`load_manifest` on the environment at `index_dir`, in a child process.

    Raises HubProtocolError for a malformed manifest, CachefsError if it cannot
    be loaded, ChildFailed if the child gave no answer."""
    command = [sys.executable, "-m", __name__, str(index_dir), str(manifest_gz)]
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    try:
        answer = json.loads(result.stdout)
    except ValueError:
        detail = result.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
        raise ChildFailed(f"the manifest loader ({sys.executable} -m {__name__}) failed: {detail[0]}") from None
    if "error" in answer:
        error = HubProtocolError if answer.get("kind") == "protocol" else CachefsError
        raise error(answer["error"])
    summary = ManifestSummary(**answer["summary"])
    log.info("loaded manifest generation %s: %d entries, %d file bytes", summary.generation, summary.entries,
             summary.file_bytes)
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


def _load(index_dir: Path, manifest_gz: Path) -> dict[str, Any]:
    """The child's work: its answer, as JSON-ready data."""
    try:
        db = open_database(index_dir)
        try:
            summary, changes = load_manifest(db, manifest_gz)
        finally:
            db.close()
    except HubProtocolError as exc:
        return {"error": str(exc), "kind": "protocol"}
    except (OSError, lmdb.Error) as exc:
        return {"error": f"cannot load the hub's manifest into {index_dir.parent}: {exc}", "kind": "storage"}
    return {
        "summary": {"generation": summary.generation, "entries": summary.entries, "file_bytes": summary.file_bytes},
        "changes": _changes_to_json(changes),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m cachefs.namespace_loader INDEX_DIR MANIFEST_GZ", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    json.dump(_load(Path(argv[0]), Path(argv[1])), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
