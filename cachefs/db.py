"""The LMDB environment in the cache dir: one file holding the namespace and the block index.

Named databases:
  meta      settings and counters (generation, block size, used bytes, ...)
  inodes    inode number -> attributes (namespace.py)
  names     parent inode + name -> inode (namespace.py)
  dirents   parent inode + position -> inode + name (namespace.py)
  blocks    BlockKey -> length, insertion sequence, chunk checksums (cache/index.py)
  fifo      insertion sequence -> BlockKey, the eviction order (cache/index.py)
  pins      file id -> file size, files kept out of eviction (cache/block_cache.py)
  verified  file id + version -> boot id: every block of that file version was
            read back and matched its checksums during that boot (cache/index.py)
  loading   inode -> nothing: the entries of the manifest being loaded, emptied
            before its transaction commits (namespace.py)

Transactions are synchronous and short; none is held across an await.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lmdb

# The map is virtual address space, not disk: 1 TiB of it costs nothing and
# holds index entries for far more blocks than any cache dir will have.
MAP_SIZE_BYTES = 1 << 40


@dataclasses.dataclass(frozen=True)
class Database:
    """An open environment and its named databases."""

    env: lmdb.Environment
    meta: lmdb._Database
    inodes: lmdb._Database
    names: lmdb._Database
    dirents: lmdb._Database
    blocks: lmdb._Database
    fifo: lmdb._Database
    pins: lmdb._Database
    verified: lmdb._Database
    loading: lmdb._Database

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()


def open_database(path: Path) -> Database:
    """Open (creating if needed) the environment at `path`.

    metasync=False: each commit still fsyncs its data pages, but not the meta
    page; a power loss may undo the last commit, never corrupt the database.
    """
    env = lmdb.open(
        str(path),
        map_size=MAP_SIZE_BYTES,
        max_dbs=16,
        metasync=False,
        readahead=False,  # random index lookups: OS readahead only wastes page cache
        max_readers=512,
    )
    return Database(
        env=env,
        meta=env.open_db(b"meta"),
        inodes=env.open_db(b"inodes"),
        names=env.open_db(b"names"),
        dirents=env.open_db(b"dirents"),
        blocks=env.open_db(b"blocks"),
        fifo=env.open_db(b"fifo"),
        pins=env.open_db(b"pins"),
        verified=env.open_db(b"verified"),
        loading=env.open_db(b"loading"),
    )


def get_meta(db: Database, key: str, default: str | None = None) -> str | None:
    with db.env.begin(db=db.meta) as txn:
        value = txn.get(key.encode())
    return value.decode() if value is not None else default


def put_meta(db: Database, key: str, value: str) -> None:
    with db.env.begin(db=db.meta, write=True) as txn:
        txn.put(key.encode(), value.encode())
