"""Loading manifests into the namespace (LMDB in a temp dir): what a new generation changes, and memory."""

from __future__ import annotations

import itertools
import os
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from manifest_helpers import dir_entry, file_entry, write_manifest

from cachefs.db import NamespaceDb, open_namespace_db
from cachefs.errors import CachefsError, HubProtocolError
from cachefs.namespace.loader import ChildFailed, load_in_child
from cachefs.namespace.tree import ROOT_INODE, ManifestSummary, Namespace, NamespaceChanges, inode_number, load_manifest


@pytest.fixture
def db(tmp_path: Path) -> Iterator[NamespaceDb]:
    opened = open_namespace_db(tmp_path / "namespace.lmdb")
    try:
        yield opened
    finally:
        opened.close()


def tree(directories: int, files_per_directory: int, version: int = 1) -> Iterator[dict[str, object]]:
    yield dir_entry("")
    for d in range(directories):
        yield dir_entry(f"d{d:04d}")
        for f in range(files_per_directory):
            yield file_entry(f"d{d:04d}/f{f:05d}.jpg", 1000 + f, version)


def names(namespace: Namespace, path: str) -> list[str]:
    directory = namespace.resolve(path)
    assert directory is not None
    return [os.fsdecode(name) for _pos, name, _inode in namespace.readdir(directory.ino, 0)]


def test_a_new_generation_lists_what_it_added_changed_and_removed(db: NamespaceDb, tmp_path: Path) -> None:
    old = [dir_entry(""), dir_entry("a"), dir_entry("a/sub"), file_entry("a/sub/gone.bin", 5), file_entry("a/keep.bin", 5),
           file_entry("a/grows.bin", 5), file_entry("a/rewritten.bin", 5), file_entry("becomes-dir", 5), file_entry("z.bin", 5)]
    _summary, first = load_manifest(db, write_manifest(tmp_path / "1.gz", "g1", old))
    assert first == NamespaceChanges()  # the kernel knows nothing yet: nothing to list
    new = [dir_entry(""), dir_entry("a"), file_entry("a/keep.bin", 5), file_entry("a/grows.bin", 6),
           file_entry("a/rewritten.bin", 5, version=2), dir_entry("becomes-dir"), file_entry("becomes-dir/x", 1),
           file_entry("new.bin", 7)]
    summary, changes = load_manifest(db, write_manifest(tmp_path / "2.gz", "g2", new))

    assert (summary.generation, summary.entries, summary.file_bytes) == ("g2", 8, 24)
    ino = inode_number
    assert sorted(changes.changed) == sorted([ino("a/grows.bin"), ino("a/rewritten.bin"), ino("becomes-dir")])
    removed = [(ino("a"), b"sub", ino("a/sub")), (ino("a/sub"), b"gone.bin", ino("a/sub/gone.bin")),
               (ROOT_INODE, b"z.bin", ino("z.bin"))]
    assert sorted(changes.removed) == sorted(removed)
    assert sorted(changes.added) == sorted([(ROOT_INODE, b"becomes-dir"), (ino("becomes-dir"), b"x"), (ROOT_INODE, b"new.bin")])
    assert changes.renewed == [(ino("a"), b"rewritten.bin")]  # a new version; a new size alone is not
    namespace = Namespace(db)
    assert names(namespace, "") == ["a", "becomes-dir", "new.bin"]
    assert names(namespace, "a") == ["keep.bin", "grows.bin", "rewritten.bin"]
    for gone in ("a/sub", "a/sub/gone.bin", "z.bin"):
        assert namespace.resolve(gone) is None and namespace.get(ino(gone)) is None
    grown = namespace.resolve("a/grows.bin")
    assert grown is not None and grown.size == 6


def test_a_broken_manifest_leaves_the_namespace_as_it_was(db: NamespaceDb, tmp_path: Path) -> None:
    load_manifest(db, write_manifest(tmp_path / "1.gz", "g1", tree(2, 3)))
    broken = [dir_entry(""), file_entry("d0000/f00000.jpg", 1)]  # before its directory
    with pytest.raises(HubProtocolError, match="comes before its directory"):
        load_manifest(db, write_manifest(tmp_path / "2.gz", "g2", broken))
    with pytest.raises(HubProtocolError, match="duplicated"):
        load_manifest(db, write_manifest(tmp_path / "3.gz", "g3", [dir_entry(""), dir_entry("a"), dir_entry("a")]))
    for field, value in (("s", -1), ("s", 1 << 64), ("t", 1 << 63),  # before: struct.error, past every handler
                         ("s", float("inf")), ("t", float("-inf")), ("m", float("inf"))):  # Infinity: OverflowError
        entry = {**file_entry("x.bin", 1), field: value}
        with pytest.raises(HubProtocolError, match="malformed manifest entry"):
            load_manifest(db, write_manifest(tmp_path / "4.gz", "g4", [dir_entry(""), entry]))
    namespace = Namespace(db)
    summary = namespace.summary()
    assert summary is not None and (summary.generation, summary.entries) == ("g1", 9)
    assert names(namespace, "d0001") == ["f00000.jpg", "f00001.jpg", "f00002.jpg"]


def test_the_top_level_directory_of_a_file(db: NamespaceDb, tmp_path: Path) -> None:
    entries = [dir_entry(""), file_entry("top.bin", 1), dir_entry("train"), dir_entry("train/n01"),
               file_entry("train/n01/x.jpg", 1), file_entry("train/n01/y.jpg", 1), dir_entry("val"), file_entry("val/z.jpg", 1)]
    load_manifest(db, write_manifest(tmp_path / "1.gz", "g1", entries))
    namespace, directories = Namespace(db), {}

    def top(path: str) -> str | None:
        return namespace.top_level_name(inode_number(path).to_bytes(8, "big"), directories)

    paths = ("top.bin", "train/n01/x.jpg", "train/n01/y.jpg", "val/z.jpg")
    assert [top(path) for path in paths] == [".", "train", "train", "val"]
    assert top("train/n01/missing.jpg") is None and top("train") is None  # not a file of the snapshot
    assert directories == {inode_number("train"): "train", inode_number("train/n01"): "train", inode_number("val"): "val"}


def peak_python_bytes(load: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        load()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_loading_and_refreshing_do_not_copy_the_namespace_into_memory(db: NamespaceDb, tmp_path: Path) -> None:
    """A refresh compares the new manifest with the old namespace in LMDB, and the first load
    lists nothing: the daemon's memory does not grow with the entries (before: ~290 bytes
    each for a refresh, ~400 MiB for ImageNet's 1.28 M files, and ~200 for the first load)."""
    directories, per_directory = 40, 1000
    entries = directories * per_directory
    first = write_manifest(tmp_path / "1.gz", "g1", tree(directories, per_directory))
    peak = peak_python_bytes(lambda: load_manifest(db, first))
    assert peak / entries < 40, f"first load: {peak / entries:.0f} bytes per entry"
    second = write_manifest(tmp_path / "2.gz", "g2", tree(directories - 1, per_directory))  # the last directory goes
    changes = NamespaceChanges()

    def refresh() -> None:
        nonlocal changes
        _summary, changes = load_manifest(db, second)

    peak = peak_python_bytes(refresh)
    assert len(changes.removed) == per_directory + 1 and not changes.changed and not changes.added
    assert peak / entries < 40, f"refresh: {peak / entries:.0f} bytes per entry"  # the removed list: ~180 bytes each of 1,001
    assert Namespace(db).resolve(f"d{directories - 1:04d}") is None


def shown_generation(db: NamespaceDb) -> Callable[[], str | None]:
    def generation() -> str | None:
        summary = Namespace(db).summary()
        return summary.generation if summary is not None else None

    return generation


def load_via_child(db: NamespaceDb, manifest_gz: Path) -> tuple[ManifestSummary, NamespaceChanges]:
    """The child's load, its changes read into lists (and their file removed)."""
    summary, changes = trio.run(load_in_child, Path(db.env.path()), manifest_gz, shown_generation(db))
    try:
        return summary, NamespaceChanges(list(changes.changed), list(changes.removed), list(changes.added),
                                         list(changes.renewed))
    finally:
        changes.discard()


def test_the_changes_of_a_child_s_load_are_read_one_at_a_time(db: NamespaceDb, tmp_path: Path) -> None:
    """A refresh that renames every directory removes every name: the daemon reads the child's
    list of changes a record at a time (before: all at once, from JSON, ~250 bytes a name)."""

    def renamed_tree(prefix: str) -> Iterator[dict[str, object]]:
        yield dir_entry("")
        for d in range(100):
            yield dir_entry(f"{prefix}{d:03d}")
            for f in range(400):
                yield file_entry(f"{prefix}{d:03d}/f{f:05d}.jpg", 1000)

    load_via_child(db, write_manifest(tmp_path / "1.gz", "g1", renamed_tree("a")))
    manifest = write_manifest(tmp_path / "2.gz", "g2", renamed_tree("b"))
    tracemalloc.start()
    try:
        summary, changes = trio.run(load_in_child, Path(db.env.path()), manifest, shown_generation(db))
        removed = sum(1 for _ in changes.removed)
        added = sum(1 for _ in changes.added)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    changes.discard()
    assert (summary.entries, len(changes.removed), removed, len(changes.added), added) == (40_101, 40_100, 40_100, 40_100, 40_100)
    assert peak < 2 << 20, f"{peak / 2**20:.1f} MiB for 40,100 names removed and added"


def test_a_child_process_loads_the_manifest_beside_an_open_environment(db: NamespaceDb, tmp_path: Path) -> None:
    """The daemon loads manifests in a child process (the memory LMDB keeps after a large write
    leaves with it); its open environment sees the commit, names that are not UTF-8 included."""
    old = [dir_entry(""), file_entry("keep.bin", 1), file_entry("gone.bin", 1)]
    summary, changes = load_via_child(db, write_manifest(tmp_path / "1.gz", "g1", old))
    assert (summary.generation, summary.entries, changes) == ("g1", 3, NamespaceChanges())
    odd = os.fsdecode(b"caf\xe9-\xff.bin")  # not UTF-8
    new = [dir_entry(""), file_entry("keep.bin", 2), file_entry(odd, 1)]
    summary, changes = load_via_child(db, write_manifest(tmp_path / "2.gz", "g2", new))
    assert summary == ManifestSummary("g2", 3, 3)
    removed = [(ROOT_INODE, b"gone.bin", inode_number("gone.bin"))]
    added = [(ROOT_INODE, b"caf\xe9-\xff.bin")]
    assert changes == NamespaceChanges(changed=[inode_number("keep.bin")], removed=removed, added=added)
    assert names(Namespace(db), "") == ["keep.bin", odd]  # this process's environment sees it
    with pytest.raises(HubProtocolError, match="does not start with the root directory"):
        load_via_child(db, write_manifest(tmp_path / "3.gz", "g3", [file_entry("x", 1)]))
    with pytest.raises(CachefsError, match="cannot load the hub's manifest"):
        load_via_child(db, tmp_path / "missing.gz")
    assert Namespace(db).summary() == ManifestSummary("g2", 3, 3)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["1.gz", "2.gz", "3.gz", "namespace.lmdb"]  # no answer left


def fake_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """sys.executable becomes a shell script (the real interpreter is $REAL in it)."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\nREAL={sys.executable}\n{script}\n")
    path.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(path))


def test_a_loader_that_dies_after_committing_still_reports_the_changes(
    db: NamespaceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer is written inside the transaction: a child killed after its commit (the OOM
    killer) leaves the changes for the kernel's invalidations (before: none were reported)."""
    load_via_child(db, write_manifest(tmp_path / "1.gz", "g1", [dir_entry(""), file_entry("a", 1), file_entry("b", 1)]))
    fake_interpreter(tmp_path, monkeypatch, '"$REAL" "$@" > /dev/null; exit 137')
    summary, changes = load_via_child(db, write_manifest(tmp_path / "2.gz", "g2", [dir_entry(""), file_entry("a", 2)]))
    assert summary.generation == "g2"
    assert changes == NamespaceChanges(changed=[inode_number("a")], removed=[(ROOT_INODE, b"b", inode_number("b"))])


@pytest.mark.parametrize(
    ("script", "error", "message"),
    [
        ("exit 1", ChildFailed, "failed: exit status 1"),  # cannot import cachefs, say
        ("echo started; exit 137", CachefsError, "died before loading anything"),
    ],
)
def test_a_loader_that_fails_says_so(
    db: NamespaceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str, error: type[Exception], message: str
) -> None:
    """ChildFailed (the daemon then loads the manifest itself) only when the loader never ran."""
    fake_interpreter(tmp_path, monkeypatch, script)
    with pytest.raises(error, match=message) as raised:
        load_via_child(db, write_manifest(tmp_path / "1.gz", "g1", [dir_entry("")]))
    assert isinstance(raised.value, ChildFailed) == (error is ChildFailed)
    assert Namespace(db).summary() is None


def test_a_loader_that_cannot_start_says_so(db: NamespaceDb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with pytest.raises(ChildFailed, match="cannot run"):
        load_via_child(db, write_manifest(tmp_path / "1.gz", "g1", [dir_entry("")]))


def test_a_readdir_resumed_across_a_new_generation_lists_every_kept_name_once(db: NamespaceDb, tmp_path: Path) -> None:
    """The kernel resumes a readdir at the offset the last reply gave: a refresh in between must not
    shift the names both generations have (a listing of a large directory spans several replies)."""
    old = [f"f{i:04d}" for i in range(1000)]
    new = [name for i, name in enumerate(old) if i % 10] + [f"new{i:04d}" for i in range(100)]
    load_manifest(db, write_manifest(tmp_path / "1.gz", "g1", [dir_entry(""), dir_entry("d")]
                                     + [file_entry(f"d/{name}", 1) for name in old]))
    namespace = Namespace(db)
    directory = namespace.resolve("d")
    assert directory is not None
    first = list(itertools.islice(namespace.readdir(directory.ino, 0), 500))
    listed, offset = [os.fsdecode(name) for _next, name, _inode in first], first[-1][0]
    load_manifest(db, write_manifest(tmp_path / "2.gz", "g2", [dir_entry(""), dir_entry("d")]
                                     + [file_entry(f"d/{name}", 1) for name in new]))
    listed += [os.fsdecode(name) for _offset, name, _inode in namespace.readdir(directory.ino, offset)]
    kept = set(old) & set(new)
    assert sorted(name for name in listed if name in kept) == sorted(kept)
    assert set(new) - set(listed) == set()  # the names added come after every old one
    assert sorted(names(namespace, "d")) == sorted(new)  # a fresh listing: the new generation only
    assert len(names(namespace, "d")) == len(new)
    # a name removed and added back keeps no stale entry
    load_manifest(db, write_manifest(tmp_path / "3.gz", "g3", [dir_entry(""), dir_entry("d")]
                                     + [file_entry(f"d/{name}", 1) for name in old]))
    assert sorted(names(namespace, "d")) == sorted(old)
