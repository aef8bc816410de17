"""BlockCache: verified reads and crash-safe inserts over the index and the store."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import lmdb
import xxhash

from ..db import Database
from ..metrics import Stats
from .index import BlockIndex
from .keys import BlockData, BlockKey
from .store import BlockStore

log = logging.getLogger(__name__)

# Eviction brings usage down to this share of the limit, so that it runs in
# batches rather than once per inserted block.
LOW_WATERMARK = 0.9
EVICT_BATCH = 64


def checksum(data: BlockData) -> int:
    """xxh3_64: ~20 GB/s, so verifying every block read costs ~50 us per MiB."""
    return xxhash.xxh3_64_intdigest(data)


class BlockCache:
    """Blocks on local disk, indexed in LMDB, kept under `capacity_bytes`.

    `lookup` runs on the trio thread (short LMDB read + pread); `insert_many`
    writes files and does an fsync'd commit, so it runs in a worker thread.
    Any failure of the cache is a miss, never a failed read.
    """

    def __init__(self, db: Database, cache_dir: Path, capacity_bytes: int, stats: Stats) -> None:
        self.index = BlockIndex(db)
        self.store = BlockStore(cache_dir)
        self.capacity_bytes = capacity_bytes
        self._stats = stats
        self._evict_lock = threading.Lock()
        self._store_failing = False

    def lookup(self, key: BlockKey) -> bytes | None:
        """The block's verified bytes, or None on a miss (corrupt blocks are dropped)."""
        entry = self.index.get(key)
        if entry is None:
            return None
        try:
            data = self.store.read(key, entry.length)
        except OSError as exc:
            log.warning("cannot read cached %s: %s", key, exc)
            data = None
        if data is None or checksum(data) != entry.checksum:
            log.warning("cached %s is missing or corrupt; dropping it", key)
            self._stats.corrupt_blocks += 1
            self.remove(key)
            return None
        return data

    def insert_many(self, blocks: list[tuple[BlockKey, BlockData]]) -> int:
        """Store blocks (worker thread): write the files, then commit their
        index entries together. Returns how many were cached; a block that
        cannot be written (e.g. ENOSPC) is skipped and logged once."""
        blocks = blocks[: self._make_room(blocks)]
        written = []
        for key, data in blocks:
            try:
                self.store.write(key, data)
            except OSError as exc:
                self._note_store_failure(exc)
                continue
            written.append((key, len(data), checksum(data)))
        if not written:
            return 0
        try:
            self.index.add(written)
        except lmdb.Error as exc:
            for key, _length, _checksum in written:
                self.store.delete(key)
            self._note_store_failure(exc)
            return 0
        if self._store_failing:
            log.info("caching blocks in %s again", self.store.blocks_dir)
            self._store_failing = False
        return len(written)

    def _note_store_failure(self, exc: Exception) -> None:
        self._stats.store_errors += 1
        if not self._store_failing:
            log.error("cannot cache blocks in %s (%s); serving without caching", self.store.blocks_dir, exc)
            self._store_failing = True

    def remove(self, key: BlockKey) -> None:
        self.index.remove(key)
        self.store.delete(key)

    def used_bytes(self) -> int:
        return self.index.used_bytes()

    def block_count(self) -> int:
        return self.index.block_count()

    def _make_room(self, blocks: list[tuple[BlockKey, BlockData]]) -> int:
        """Evict so that the blocks fit under the capacity before they are written.

        Returns how many of the blocks fit (all, unless the batch alone is
        larger than the whole cache). Usage on disk so never exceeds the limit.
        """
        fitting, incoming = 0, 0
        for _key, data in blocks:
            if incoming + len(data) > self.capacity_bytes:
                break
            incoming += len(data)
            fitting += 1
        if self.index.used_bytes() + incoming > self.capacity_bytes:
            self._evict_down_to(min(int(self.capacity_bytes * LOW_WATERMARK), self.capacity_bytes - incoming))
        return fitting

    def _evict_down_to(self, target: int) -> None:
        with self._evict_lock:
            while self.index.used_bytes() > target:
                victims = self.index.oldest(EVICT_BATCH)
                if not victims:
                    break
                for key in victims:
                    if self.index.remove(key):
                        self.store.delete(key)
                        self._stats.evicted_blocks += 1
