"""The policy that splits a shared cache dir among its tenants (cache/tenants.py `allowances`),
and one tenant's share of it against real records and a real BlockCache in a temp dir."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from spoke_parts import BLOCK, VERSION

from cachefs.cache import BlockCache, BlockKey
from cachefs.cache.share import TenantShare
from cachefs.cache.tenants import DEFAULT_TENANT, Ledger, TenantRecord, allowances, tenant_dir
from cachefs.db import open_index_db, put_meta
from cachefs.errors import CachefsError
from cachefs.metrics import Stats

POOL = 100


def tenant(name: str, *, live: bool = True, min_bytes: int = 0, max_bytes: int = POOL, used: int = 0,
           pinned: int = 0, want: int | None = None, rate: float = 0.0) -> TenantRecord:
    return TenantRecord(name=name, pid=1, pool_bytes=POOL, min_bytes=min_bytes, max_bytes=max_bytes, used_bytes=used,
                        pinned_bytes=pinned, want_bytes=POOL if want is None else want, use_rate=rate, live=live)


def test_a_tenant_alone_may_use_the_whole_size_even_when_it_wants_little() -> None:
    assert allowances(POOL, [tenant("a", want=10, rate=5.0)]) == {"a": POOL}
    assert allowances(POOL, [tenant("a", want=10)]) == {"a": POOL}  # idle too


def test_minimums_are_guaranteed_and_the_rest_follows_recent_use() -> None:
    shares = allowances(POOL, [tenant("cyclic", min_bytes=40, want=30, rate=1.0), tenant("scan", rate=50.0)])
    assert shares == {"cyclic": 40, "scan": 60}  # the cyclic job wants less than its minimum: the scanner gets the rest
    shares = allowances(POOL, [tenant("a", rate=3.0), tenant("b", rate=1.0)])
    assert shares == {"a": 75, "b": 25}
    shares = allowances(POOL, [tenant("a", min_bytes=50, rate=1.0), tenant("b", rate=3.0)])
    assert shares["a"] - 50 in (12, 13) and sum(shares.values()) == POOL  # the room above the minimums, by use


def test_a_cap_is_kept_and_its_excess_goes_to_the_others() -> None:
    shares = allowances(POOL, [tenant("a", max_bytes=20, rate=9.0), tenant("b", rate=1.0)])
    assert shares == {"a": 20, "b": 80}


def test_an_idle_tenant_keeps_its_blocks_only_while_nobody_needs_the_room() -> None:
    assert allowances(POOL, [tenant("idle", used=30, want=32), tenant("busy", want=50, rate=4.0)]) == {"idle": 32, "busy": 68}
    assert allowances(POOL, [tenant("idle", used=30, want=32), tenant("busy", rate=4.0)]) == {"idle": 0, "busy": 100}
    assert allowances(POOL, [tenant("idle", min_bytes=20, used=30, want=32), tenant("busy", rate=4.0)]) == {
        "idle": 20, "busy": 80}


def test_an_unmounted_tenant_has_no_minimum_but_keeps_pins_and_unneeded_bytes() -> None:
    dead = tenant("dead", live=False, min_bytes=60, used=60, want=60, pinned=10)
    assert allowances(POOL, [dead, tenant("busy", rate=1.0)]) == {"dead": 10, "busy": 90}
    assert allowances(POOL, [dead, tenant("busy", want=30, rate=1.0)]) == {"dead": 60, "busy": 40}


def test_the_allowances_never_add_up_to_more_than_the_size() -> None:
    for count in range(1, 8):
        tenants = [tenant(f"t{i}", min_bytes=i * 3, max_bytes=POOL - i, want=i * 20, rate=float(i % 3), used=i * 7)
                   for i in range(count)]
        shares = allowances(POOL, tenants)
        assert sum(shares.values()) <= POOL
        for record in tenants:
            assert min(record.min_bytes, record.max_bytes) <= shares[record.name] <= record.max_bytes


# -- one tenant's share, with real records in a temp dir ---------------------------------------


@contextlib.contextmanager
def tenant_cache(
    pool_dir: Path, name: str, *, min_bytes: int = 0, pool_blocks: int = 8
) -> Iterator[tuple[BlockCache, TenantShare]]:
    """A tenant's BlockCache of a shared cache dir, holding its lock as its daemon would."""
    directory = tenant_dir(pool_dir, name)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    db = open_index_db(directory / "index.lmdb")
    stats = Stats()
    share = TenantShare(Ledger(pool_dir), directory, name, pool_bytes=pool_blocks * BLOCK, min_bytes=min_bytes,
                        max_bytes=pool_blocks * BLOCK, block_size=BLOCK, stats=stats)
    try:
        share.check_mount()
        cache = BlockCache(db, directory, pool_blocks * BLOCK, BLOCK, stats, share=share)
        share.refresh(cache.used_bytes, 0, cache.pressure)
        yield cache, share
    finally:
        db.close()
        os.close(fd)


def fill(cache: BlockCache, file_number: int, blocks: int) -> int:
    file_id = file_number.to_bytes(8, "big")
    return sum(cache.insert_many([(BlockKey(file_id, VERSION, n), os.urandom(BLOCK), False)]) for n in range(blocks))


def test_a_tenant_never_grows_into_bytes_another_holds(tmp_path: Path) -> None:
    with tenant_cache(tmp_path, DEFAULT_TENANT) as (first, _), tenant_cache(tmp_path, "second") as (second, share):
        assert fill(first, 1, 6) == 6
        assert fill(second, 2, 6) == 2  # the size is 8 blocks: only 2 were free, even though it is allowed all
        assert first.used_bytes() + second.used_bytes() == 8 * BLOCK
        assert {r.name: r.used_bytes for r in Ledger(tmp_path).records()} == {"default": 6 * BLOCK, "second": 2 * BLOCK}
        assert share.snapshot(second.used_bytes(), 0)["tenants"][0]["live"]


def test_a_write_that_fails_leaves_no_claim_on_the_others_room(tmp_path: Path) -> None:
    """Room is claimed before a batch is written; a batch that cannot be written (a full disk)
    must give it back, not keep publishing it until a later write succeeds."""
    def full_disk(_key: BlockKey, _data: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with tenant_cache(tmp_path, "a") as (a, share):
        a.store.write = full_disk  # type: ignore[method-assign]
        assert fill(a, 1, 4) == 0
        published = Ledger.read(tenant_dir(tmp_path, "a"))  # what others' limits read
        assert published is not None and published.used_bytes == 0
        share.refresh(a.used_bytes, 0, a.pressure)
        published = Ledger.read(tenant_dir(tmp_path, "a"))
        assert published is not None and published.used_bytes == a.used_bytes() == 0


def test_a_tenant_above_its_allowance_trims_its_own_blocks_and_the_other_grows(tmp_path: Path) -> None:
    with tenant_cache(tmp_path, "idle") as (idle, idle_share), tenant_cache(tmp_path, "busy") as (busy, busy_share):
        fill(idle, 1, 6)
        idle_share.refresh(idle.used_bytes, 0, idle.pressure)
        busy._stats.read_bytes += 10 * BLOCK  # it has been reading
        fill(busy, 2, 4)  # turned away: only 2 blocks were free
        assert busy.used_bytes() == 2 * BLOCK
        busy_share.refresh(busy.used_bytes, 0, busy.pressure)  # wants its cap now, and the idle one is idle
        allowance = idle_share.refresh(idle.used_bytes, 0, idle.pressure)
        assert allowance < 6 * BLOCK
        idle.trim(allowance)
        assert idle.used_bytes() <= allowance
        busy_share.refresh(busy.used_bytes, 0, busy.pressure)
        assert fill(busy, 3, 4) == 4


def test_pins_of_one_tenant_cannot_take_another_s_minimum(tmp_path: Path) -> None:
    with tenant_cache(tmp_path, "guarded", min_bytes=5 * BLOCK), tenant_cache(tmp_path, "pinner") as (pinner, _):
        with pytest.raises(CachefsError, match="the other tenants' minimums and pins leave this one"):
            pinner.pin({b"f" * 8: 4 * BLOCK})
        pinner.pin({b"f" * 8: 3 * BLOCK})


def test_pins_of_two_tenants_made_one_after_the_other_never_exceed_the_size(tmp_path: Path) -> None:
    """A pin is published when it is made, not at the next refresh a second later: two tenants
    pinning at about the same time (two `cachefs warm --pin`) cannot together pin more than the size."""
    with tenant_cache(tmp_path, "a") as (a, _), tenant_cache(tmp_path, "b") as (b, _):
        a.pin({b"p" * 8: 5 * BLOCK})
        with pytest.raises(CachefsError, match="the other tenants' minimums and pins leave this one"):
            b.pin({b"q" * 8: 5 * BLOCK})
        b.pin({b"q" * 8: 3 * BLOCK})


def test_an_unmounted_tenant_s_pins_count_against_minimums_and_pins_of_others(tmp_path: Path) -> None:
    """Reclaim never takes an unmounted tenant's pinned blocks: a minimum that does not fit
    beside them is refused at mount, and so are pins beyond what they leave."""
    with tenant_cache(tmp_path, "gone") as (gone, share):
        gone.pin({b"p" * 8: 6 * BLOCK})
        share.refresh(gone.used_bytes, gone.pinned_bytes(), gone.pressure)
    with pytest.raises(CachefsError, match="are guaranteed 384.0 KiB of its 512.0 KiB"), \
            tenant_cache(tmp_path, "busy", min_bytes=4 * BLOCK):
        pass
    with tenant_cache(tmp_path, "busy", min_bytes=2 * BLOCK) as (busy, _):
        with pytest.raises(CachefsError, match="the other tenants' minimums and pins leave this one"):
            busy.pin({b"q" * 8: 3 * BLOCK})
        busy.pin({b"q" * 8: 2 * BLOCK})


def test_a_record_survives_a_round_trip_and_a_torn_one_is_not_taken(tmp_path: Path) -> None:
    record = tenant("x", used=5, rate=2.5)
    Ledger.publish(tmp_path, record)
    assert Ledger.read(tmp_path, live=True) == dataclasses.replace(record, live=True)
    Ledger.publish(tmp_path, dataclasses.replace(record, used_bytes=123456))
    assert Ledger.read(tmp_path) == dataclasses.replace(record, used_bytes=123456, live=False)
    data = bytearray((tmp_path / "tenant.record").read_bytes())
    data[data.index(b"123456")] = ord("9")  # caught half rewritten
    (tmp_path / "tenant.record").write_bytes(data)
    assert Ledger.read(tmp_path) is None


def test_an_unmounted_tenant_s_oldest_blocks_are_reclaimed_when_a_mounted_one_needs_the_room(tmp_path: Path) -> None:
    with tenant_cache(tmp_path, "gone") as (gone, gone_share):
        fill(gone, 1, 6)
        gone_share.refresh(gone.used_bytes, 0, gone.pressure)
        oldest = BlockKey((1).to_bytes(8, "big"), VERSION, 0)
        assert gone.contains(oldest)
    # Its daemon is gone (its lock is free); a mounted tenant that reads, and turns blocks away, needs the room.
    with tenant_cache(tmp_path, "busy") as (busy, share):
        busy._stats.read_bytes += 10 * BLOCK
        assert fill(busy, 2, 4) == 2
        share.refresh(busy.used_bytes, 0, busy.pressure)
        assert fill(busy, 3, 6) == 6
        assert busy.used_bytes() == 8 * BLOCK
    record = Ledger.read(tenant_dir(tmp_path, "gone"))
    assert record is not None and record.used_bytes == 0 and record.pid == 0
    with tenant_cache(tmp_path, "gone") as (gone, _):
        assert gone.used_bytes() == 0 and not gone.contains(oldest)


def test_an_unmounted_tenant_s_blocks_behind_a_large_pinned_file_are_reclaimed_too(tmp_path: Path) -> None:
    """Reclaim walks the unmounted tenant's blocks oldest first past its pinned ones, however
    many: a window of the oldest blocks would be filled by a large pinned file among them."""
    pool = 2000
    with tenant_cache(tmp_path, "gone", pool_blocks=pool) as (gone, share):
        put_meta(gone._db, "block_size", str(BLOCK))  # as the daemon records it
        gone.pin({(1).to_bytes(8, "big"): 1400 * BLOCK})
        assert fill_in_batches(gone, 1, 1400) == 1400  # pinned, the oldest
        assert fill_in_batches(gone, 2, 600) == 600  # unpinned, newer
        share.refresh(gone.used_bytes, gone.pinned_bytes(), gone.pressure)
    # Its daemon is gone; a mounted tenant with a 300-block minimum (1,400 pinned + 300 fits) needs it.
    with tenant_cache(tmp_path, "busy", min_bytes=300 * BLOCK, pool_blocks=pool) as (busy, busy_share):
        busy_share.refresh(busy.used_bytes, 0, busy.pressure)
        assert fill_in_batches(busy, 3, 300) == 300
    record = Ledger.read(tenant_dir(tmp_path, "gone"))
    assert record is not None and record.used_bytes <= (pool - 300) * BLOCK and record.pinned_bytes == 1400 * BLOCK


def fill_in_batches(cache: BlockCache, file_number: int, blocks: int) -> int:
    file_id = file_number.to_bytes(8, "big")
    return sum(cache.insert_many([(BlockKey(file_id, VERSION, n), os.urandom(BLOCK), False)
                                  for n in range(start, min(blocks, start + 100))]) for start in range(0, blocks, 100))
