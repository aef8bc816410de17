"""A real BlockCache (LMDB index and data files) in a temp dir, for tests below the mount."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from cachefs.cache import BlockCache
from cachefs.db import open_index_db
from cachefs.metrics import Stats


@contextlib.contextmanager
def block_cache(directory: Path, capacity_bytes: int, block_size: int) -> Iterator[BlockCache]:
    db = open_index_db(directory / "index.lmdb")
    try:
        yield BlockCache(db, directory, capacity_bytes, block_size, Stats())
    finally:
        db.close()
