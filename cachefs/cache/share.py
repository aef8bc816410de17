"""This mount's share of a cache dir that several mounts (tenants) use: its allowance,
kept fresh from the ledger, its record published, and unmounted tenants' bytes reclaimed.

The cache (block_cache.py) asks `limit` before admitting blocks and reports
its bytes after each commit; the daemon calls `refresh` every
REFRESH_INTERVAL_S and trims the cache to the allowance it returns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb

from ..config import format_size
from ..db import INDEX_DIR, get_meta, open_index_db
from ..errors import UsageError
from ..metrics import Stats
from .index import BlockIndex
from .keys import BlockKey
from .store import BlockStore
from .tenants import Ledger, TenantRecord, allowances, locked_if_dead

log = logging.getLogger(__name__)

ADMISSION_LOCK = "admission.lock"
# How often each tenant recomputes its allowance and publishes its record:
# an allowance that shrank is reached within this long.
REFRESH_INTERVAL_S = 1.0
# Recent use is read bytes per second, averaged over about this long; a tenant
# that had to turn blocks away wants its cap for as long.
USE_WINDOW_S = 10.0
# A tenant not turning blocks away wants this many blocks (at most 1/32 of the
# size) over what it holds: room to grow until its next refresh, which finds
# it turning blocks away if that was too little.
GROWTH_BLOCKS = 64
# Bytes of an unmounted tenant reclaimed per refresh, so its lock is held briefly.
RECLAIM_BATCH_BYTES = 256 << 20


class TenantShare:
    """One tenant's view of the shared cache dir (its calls come from worker threads)."""

    def __init__(
        self,
        ledger: Ledger,
        directory: Path,
        name: str,
        *,
        pool_bytes: int,
        min_bytes: int,
        max_bytes: int,
        block_size: int,
        stats: Stats,
    ) -> None:
        self._ledger = ledger
        self._directory = directory
        self.name = name
        self.pool_bytes = pool_bytes
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._growth_bytes = min(GROWTH_BLOCKS * block_size, pool_bytes // 32)
        self._stats = stats
        self.allowance = min(max_bytes, pool_bytes)  # until the first refresh
        self._rate = 0.0
        self._last = (time.monotonic(), stats.read_bytes)
        self._pressure_seen = 0
        self._pressed_until = 0.0  # it wants its cap until then: it was turning blocks away lately
        self._claimed = 0  # bytes claimed for blocks being written, not in the index yet
        self._record = self._make_record(0, 0, 0)

    def check_mount(self) -> None:
        """Refuse a mount whose sizes do not fit those of the live tenants (one line)."""
        if self.min_bytes > self.max_bytes:
            raise UsageError(f"--cache-min {format_size(self.min_bytes)} is more than --cache-max {format_size(self.max_bytes)}")
        with self.admitting():  # two tenants mounting at once see each other's minimum
            self._check_mount()

    def _check_mount(self) -> None:
        others = [r for r in self._ledger.records() if r.live and r.name != self.name]
        for other in others:
            if other.pool_bytes != self.pool_bytes:
                raise UsageError(f"cache dir {self._ledger.cache_dir} is shared with tenant {other.name!r}, mounted with "
                                 f"--cache-size {format_size(other.pool_bytes)}: mount with the same --cache-size")
        guaranteed = self._others_guaranteed()
        if guaranteed + self.min_bytes > self.pool_bytes:
            raise UsageError(f"--cache-min {format_size(self.min_bytes)} does not fit: the other tenants of "
                             f"{self._ledger.cache_dir} are guaranteed {format_size(guaranteed)} of its "
                             f"{format_size(self.pool_bytes)} (mounted ones' minimums, and pins)")
        last = self._ledger.read(self._directory)  # what it held when it last ran, until its first refresh
        self._publish(self._make_record(last.used_bytes if last else 0, last.pinned_bytes if last else 0, 0))

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Hold the cache dir's admission lock: a tenant decides what to admit and claims its
        bytes (`note_used`) before another can, so the tenants together never exceed the size."""
        fd = os.open(self._ledger.cache_dir / ADMISSION_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def limit(self, used_bytes: int) -> int:
        """The most this tenant may hold now: its allowance, and no growth into bytes others hold."""
        others = sum(r.used_bytes for r in self._ledger.records(check_live=False) if r.name != self.name)
        return min(self.allowance, max(used_bytes, self.pool_bytes - others))

    def pin_limit(self) -> int:
        """The most this tenant may pin: what the others' minimums and pins leave."""
        return min(self.max_bytes, self.pool_bytes - self._others_guaranteed())

    def _others_guaranteed(self) -> int:
        """What the other tenants keep whatever this one does: a mounted one its minimum (or its
        pins, if more; up to its maximum), an unmounted one its pins (reclaim never takes them)."""
        return sum(min(r.max_bytes, max(r.min_bytes, r.pinned_bytes)) if r.live else r.pinned_bytes
                   for r in self._ledger.records() if r.name != self.name)

    def claim(self, used_bytes: int, pinned_bytes: int, claimed_bytes: int) -> None:
        """Publish the bytes held plus those about to be written (under `admitting`); `note_used` follows."""
        self._claimed = claimed_bytes
        self._publish(dataclasses.replace(self._record, used_bytes=used_bytes + claimed_bytes, pinned_bytes=pinned_bytes,
                                          updated=time.time()))

    def note_used(self, used_bytes: int, pinned_bytes: int) -> None:
        """Publish the bytes held right after they changed (others' `limit` reads them)."""
        self._claimed = 0
        self._publish(dataclasses.replace(self._record, used_bytes=used_bytes, pinned_bytes=pinned_bytes, updated=time.time()))

    def refresh(self, used: Callable[[], int], pinned_bytes: int, pressure: int) -> int:
        """Recompute the allowance from the ledger, publish this tenant's record, reclaim what
        unmounted tenants hold beyond theirs; returns the allowance."""
        with self.admitting():  # what it holds and has claimed, read while nothing is being claimed
            claimed = self._claimed
            used_bytes = used()
            others, allowed = self._refresh(used_bytes + claimed, pinned_bytes, pressure)
        self._reclaim_dead(others, allowed)
        return self.allowance

    def _refresh(self, used_bytes: int, pinned_bytes: int, pressure: int) -> tuple[list[TenantRecord], dict[str, int]]:
        now = time.monotonic()
        then, read_then = self._last
        elapsed = max(1e-3, now - then)
        weight = min(1.0, elapsed / USE_WINDOW_S)
        self._rate += weight * ((self._stats.read_bytes - read_then) / elapsed - self._rate)
        self._last = (now, self._stats.read_bytes)
        if pressure != self._pressure_seen:  # it turned blocks away (or evicted for them) since the last refresh
            self._pressed_until = now + USE_WINDOW_S
        self._pressure_seen = pressure
        want = self.max_bytes if now < self._pressed_until else min(self.max_bytes, used_bytes + self._growth_bytes)
        record = self._make_record(used_bytes, pinned_bytes, want)
        others = [r for r in self._ledger.records() if r.name != self.name]
        allowed = allowances(self.pool_bytes, [*others, dataclasses.replace(record, live=True)])
        self.allowance = allowed[self.name]
        self._publish(record)
        return others, allowed

    def snapshot(self, used_bytes: int, pinned_bytes: int) -> dict[str, Any]:
        """This tenant's name and allowance, and every tenant of the cache dir as it published itself
        (this one with its counters now), with the allowance the policy gives each."""
        mine = dataclasses.replace(self._make_record(used_bytes, pinned_bytes, self._record.want_bytes), live=True)
        records = sorted([*(r for r in self._ledger.records() if r.name != self.name), mine], key=lambda r: r.name)
        allowed = allowances(self.pool_bytes, records)
        return {
            "name": self.name,
            "pool_bytes": self.pool_bytes,
            "allowance_bytes": self.allowance,
            "tenants": [{**dataclasses.asdict(r), "allowance_bytes": allowed[r.name]} for r in records],
        }

    def _make_record(self, used_bytes: int, pinned_bytes: int, want: int) -> TenantRecord:
        return TenantRecord(
            name=self.name, pid=os.getpid(), pool_bytes=self.pool_bytes, min_bytes=self.min_bytes,
            max_bytes=self.max_bytes, used_bytes=used_bytes, pinned_bytes=pinned_bytes, want_bytes=want,
            use_rate=self._rate, block_hits=self._stats.block_hits, block_misses=self._stats.block_misses,
            fetched_bytes=self._stats.fetched_bytes, updated=time.time(),
        )

    def _publish(self, record: TenantRecord) -> None:
        self._record = record
        try:
            self._ledger.publish(self._directory, record)
        except OSError as exc:  # the others then see this tenant's last record: its bytes are counted as they were
            log.warning("cannot publish this tenant's use in %s: %s", self._directory, exc)

    def _reclaim_dead(self, others: list[TenantRecord], allowed: dict[str, int]) -> None:
        """Evict the oldest blocks of unmounted tenants beyond their allowance (and count those never counted)."""
        published = {r.name: r for r in others}
        for name, directory in self._ledger.tenant_dirs().items():
            record = published.get(name)
            if name == self.name or (record is not None and (record.live or record.used_bytes <= allowed[name])):
                continue
            keep = allowed[name] if record is not None else None
            try:
                reclaim(directory, name, keep, self.pool_bytes)
            except (OSError, lmdb.Error) as exc:
                log.warning("cannot reclaim the cache of unmounted tenant %r: %s", name, exc)


def reclaim(directory: Path, name: str, keep_bytes: int | None, pool_bytes: int) -> int:
    """Under an unmounted tenant's lock: evict its oldest unpinned blocks down toward `keep_bytes`
    (None: only count them), and publish what it holds. Returns the bytes freed."""
    with locked_if_dead(directory) as dead:
        if not dead or not (directory / INDEX_DIR).is_dir():
            return 0
        db = open_index_db(directory / INDEX_DIR)
        try:
            index = BlockIndex(db)
            freed = 0
            if keep_bytes is not None and index.used_bytes() > keep_bytes:
                block_size = int(get_meta(db, "block_size") or 0)
                with db.env.begin(db=db.pins) as txn:
                    pinned = {bytes(file_id) for file_id, _size in txn.cursor()}
                store = BlockStore(directory, block_size) if block_size else None
                goal = min(index.used_bytes() - keep_bytes, RECLAIM_BATCH_BYTES)
                victims: list[BlockKey] = []
                with contextlib.closing(index.iter_oldest()) as oldest:  # past however many pinned blocks come first
                    for key in oldest:
                        if freed >= goal:
                            break
                        entry = index.get(key)
                        if key.file_id in pinned or entry is None:
                            continue
                        victims.append(key)
                        freed += entry.length
                index.remove_many(victims)
                for key in victims:
                    if store is not None:
                        store.delete(key)
                if victims:
                    log.info("reclaimed %s of unmounted tenant %r", format_size(freed), name)
            with db.env.begin(db=db.pins) as txn:
                pinned_bytes = sum(int.from_bytes(size, "big") for _file_id, size in txn.cursor())
            old = Ledger.read(directory)
            Ledger.publish(directory, TenantRecord(
                name=name, pid=0, pool_bytes=pool_bytes, min_bytes=old.min_bytes if old else 0,
                max_bytes=old.max_bytes if old else pool_bytes, used_bytes=index.used_bytes(), pinned_bytes=pinned_bytes,
                want_bytes=index.used_bytes(), use_rate=0.0, block_hits=old.block_hits if old else 0,
                block_misses=old.block_misses if old else 0, fetched_bytes=old.fetched_bytes if old else 0,
                updated=time.time(),
            ))
            return freed
        finally:
            db.close()
