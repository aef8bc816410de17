"""The two LMDB environments in the cache dir: the namespace, and the block index.

They are apart because LMDB has one writer per environment: loading a large
manifest holds the namespace's write lock for seconds (a million entries:
tens of seconds), and caching fetched blocks must not wait for it. No
transaction needs both.

`namespace.lmdb`, named databases:
  meta      generation, entries and file bytes of the snapshot loaded, hub URL
  inodes    inode number -> attributes (namespace/tree.py)
  names     parent inode + name -> inode (namespace/tree.py)
  dirents   parent inode + position -> inode + name (namespace/tree.py)
  loading   inode -> nothing: the entries of the manifest being loaded, emptied
            before its transaction commits (namespace/tree.py)

`index.lmdb`, named databases:
  meta      block size, index format, used bytes, block count, next sequence
  blocks    BlockKey -> length, insertion sequence, chunk checksums (cache/index.py)
  fifo      insertion sequence -> BlockKey, the eviction order (cache/index.py)
  pins      file id -> file size, files kept out of eviction (cache/block_cache.py)
  verified  file id + version -> boot id: every block of that file version was
            read back and matched its checksums during that boot (cache/index.py)

Cache dirs of older versions hold the namespace in `index.lmdb` too; it is
moved out once, by `open_cache_databases`. Transactions are synchronous and
short (but for a manifest's load); none is held across an await.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from pathlib import Path

import lmdb

log = logging.getLogger(__name__)

# The map is virtual address space, not disk: 1 TiB of it costs nothing and
# holds index entries for far more blocks than any cache dir will have.
MAP_SIZE_BYTES = 1 << 40

NAMESPACE_DIR = "namespace.lmdb"
INDEX_DIR = "index.lmdb"

_NAMESPACE_TABLES = (b"inodes", b"names", b"dirents")
_NAMESPACE_META = (b"generation", b"entries", b"file_bytes", b"hub_url")
_MOVE_BATCH_ENTRIES = 20_000  # entries per transaction when moving an old namespace


@dataclasses.dataclass(frozen=True)
class Environment:
    """An open environment and its settings table."""

    env: lmdb.Environment
    meta: lmdb._Database

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()


@dataclasses.dataclass(frozen=True)
class NamespaceDb(Environment):
    """The snapshot's entries (namespace/tree.py)."""

    inodes: lmdb._Database
    names: lmdb._Database
    dirents: lmdb._Database
    loading: lmdb._Database


@dataclasses.dataclass(frozen=True)
class IndexDb(Environment):
    """The block index (cache/)."""

    blocks: lmdb._Database
    fifo: lmdb._Database
    pins: lmdb._Database
    verified: lmdb._Database


def _open_env(path: Path) -> lmdb.Environment:
    """metasync=False: each commit still fsyncs its data pages, but not the meta
    page; a power loss may undo the last commit, never corrupt the database.

    Private to the daemon's user, whatever the umask: the namespace names every
    path of the dataset. (lmdb.open would make the directory with the files' mode,
    which has no search bit, so it is made here first; an older cachefs left both
    open to others.)"""
    path.mkdir(mode=0o700, exist_ok=True)
    _restrict(path, 0o700)
    for name in ("data.mdb", "lock.mdb"):
        _restrict(path / name, 0o600)
    return lmdb.open(
        str(path),
        mode=0o600,
        map_size=MAP_SIZE_BYTES,
        max_dbs=16,
        metasync=False,
        readahead=False,  # random lookups: OS readahead only wastes page cache
        max_readers=512,
    )


def _restrict(path: Path, mode: int) -> None:
    """chmod an existing file to `mode` if it grants more than that (a missing one is left alone)."""
    try:
        if stat.S_IMODE(path.stat().st_mode) & ~mode:
            path.chmod(mode)
    except FileNotFoundError:
        pass


def open_namespace_db(path: Path) -> NamespaceDb:
    """Open (creating if needed) the namespace environment at `path`."""
    env = _open_env(path)
    return NamespaceDb(
        env=env,
        meta=env.open_db(b"meta"),
        inodes=env.open_db(b"inodes"),
        names=env.open_db(b"names"),
        dirents=env.open_db(b"dirents"),
        loading=env.open_db(b"loading"),
    )


def open_index_db(path: Path) -> IndexDb:
    """Open (creating if needed) the block index environment at `path`."""
    env = _open_env(path)
    return IndexDb(
        env=env,
        meta=env.open_db(b"meta"),
        blocks=env.open_db(b"blocks"),
        fifo=env.open_db(b"fifo"),
        pins=env.open_db(b"pins"),
        verified=env.open_db(b"verified"),
    )


def open_cache_databases(cache_dir: Path) -> tuple[NamespaceDb, IndexDb]:
    """Both environments of a cache dir; an older cache dir's namespace is moved out of its index first."""
    index = open_index_db(cache_dir / INDEX_DIR)
    try:
        old_tables = _old_namespace_tables(index)
        if old_tables:
            if not (cache_dir / NAMESPACE_DIR).exists():
                _copy_old_namespace(index, cache_dir / NAMESPACE_DIR)
            _drop_old_namespace(index, old_tables)  # also when a move was cut short after its rename
        return open_namespace_db(cache_dir / NAMESPACE_DIR), index
    except BaseException:
        index.close()
        raise


def _old_namespace_tables(index: IndexDb) -> list[bytes]:
    """The namespace tables an older cachefs kept in the index environment."""
    with index.env.begin() as txn:
        present = {key for key, _ in txn.cursor()}
    return [name for name in (*_NAMESPACE_TABLES, b"loading") if name in present]


def _copy_old_namespace(index: IndexDb, destination: Path) -> None:
    """Copy the namespace an older cachefs kept in the index environment to `destination`.

    Built beside `destination` in transactions of a bounded size and renamed
    into place once complete (the directory synced): an interrupted copy
    starts again next time.
    """
    building = destination.with_name(destination.name + ".part")
    shutil.rmtree(building, ignore_errors=True)
    target = open_namespace_db(building)
    try:
        for name in _NAMESPACE_TABLES:
            _copy_table(index.env, index.env.open_db(name), target.env, getattr(target, name.decode()))
        with index.env.begin(db=index.meta) as source, target.env.begin(write=True, db=target.meta) as txn:
            for key in _NAMESPACE_META:
                value = source.get(key)
                if value is not None:
                    txn.put(key, value)
    finally:
        target.close()
    building.rename(destination)
    directory = os.open(destination.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename is on disk before the old tables go
    finally:
        os.close(directory)
    log.info("moved the namespace out of the block index into %s", destination)


def _drop_old_namespace(index: IndexDb, tables: list[bytes]) -> None:
    with index.env.begin(write=True) as txn:
        for name in tables:
            txn.drop(index.env.open_db(name, txn=txn), delete=True)
        for key in _NAMESPACE_META:
            txn.delete(key, db=index.meta)


def _copy_table(source_env: lmdb.Environment, source: lmdb._Database,
                target_env: lmdb.Environment, target: lmdb._Database) -> None:
    """Copy every key of `source` into `target`, in sorted order, a batch per transaction."""
    after: bytes | None = None
    while True:
        with source_env.begin(db=source) as txn:
            cursor = txn.cursor()
            found = cursor.set_range(after) if after is not None else cursor.first()
            if found and after is not None and cursor.key() == after:
                found = cursor.next()
            batch: list[tuple[bytes, bytes]] = []
            while found and len(batch) < _MOVE_BATCH_ENTRIES:
                batch.append(cursor.item())
                found = cursor.next()
        if not batch:
            return
        with target_env.begin(write=True, db=target) as txn:
            txn.cursor().putmulti(batch, append=True)
        after = batch[-1][0]


def get_meta(db: Environment, key: str, default: str | None = None) -> str | None:
    with db.env.begin(db=db.meta) as txn:
        value = txn.get(key.encode())
    return value.decode() if value is not None else default


def put_meta(db: Environment, key: str, value: str) -> None:
    with db.env.begin(db=db.meta, write=True) as txn:
        txn.put(key.encode(), value.encode())
