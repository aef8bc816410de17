"""FUSE passthrough (on by default): whole, verified cached files are read by the kernel
from the cache's data files, which are sealed and re-verified on a period; anything else,
and every read with --no-passthrough, through the daemon."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio
from cache_helpers import block_cache
from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE
from hub_helpers import HubProcess, free_port, hub_health, running_hub, wait_for_generation_change
from mount_helpers import (
    SpokeMount,
    cache_data_files,
    evict_from_page_cache,
    mounted_spoke,
    read_uncached,
    resident_pages,
    run_cachefs,
    spoke_metrics,
    wait_for_stats,
)

from cachefs.cache import BlockCache, BlockKey
from cachefs.cache import block_cache as block_cache_module
from cachefs.cache import store as store_module
from cachefs.cache.block_cache import boot_id
from cachefs.config import PassthroughMode
from cachefs.fs import passthrough as passthrough_module
from cachefs.fs.passthrough import Passthrough
from cachefs.fs.reverify import Reverifier
from cachefs.metrics import Stats
from cachefs.namespace.tree import KIND_FILE, Inode

SHARD = "shards/shard-000.bin"  # 3 MiB + 17: 49 test blocks, the last one short
ARGS = (*SPOKE_ARGS, "--prefetch-siblings", "0", "--passthrough")  # only the files a test reads get cached


def _read_through_kernel(spoke: SpokeMount, relative: str) -> tuple[bytes, dict[str, int]]:
    """Read a file whole with the cache's data files out of the page cache; returns
    its bytes and how the daemon's read and passthrough counters moved."""
    before = spoke.stats()
    evict_from_page_cache(cache_data_files(spoke.cache_dir))
    data = read_uncached(spoke.mountpoint / relative)
    after = spoke.stats()
    return data, {name: after[name] - before[name] for name in ("reads", "passthrough_opens")}


def test_a_file_read_whole_is_then_read_by_the_kernel_from_the_cache(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    source = (dataset / SHARD).read_bytes()
    cache_dir = tmp_path / "cache"
    with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
        assert read_uncached(spoke.mountpoint / SHARD) == source
        wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}  # no read reached the daemon
        # Ranges across block boundaries and the end of the file, from the data file on disk.
        reads_before = spoke.stats()["reads"]
        for offset, length in [(0, 1), (TEST_BLOCK_SIZE - 3, 10), (5 * TEST_BLOCK_SIZE + 7, 3 * TEST_BLOCK_SIZE),
                               (len(source) - 20, 100), (len(source), 10)]:
            evict_from_page_cache(cache_data_files(cache_dir))
            assert read_uncached(spoke.mountpoint / SHARD, offset, length) == source[offset : offset + length]
        assert spoke.stats()["reads"] == reads_before
    # A new daemon in the same boot trusts the verification: the first open is direct.
    with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}
        assert spoke.stats()["fetched_bytes"] == 0


def test_a_file_is_verified_from_the_disk_and_leaves_no_copy_in_the_page_cache(hub: HubProcess, dataset: Path,
                                                                                tmp_path: Path) -> None:
    """The read-back that verifies a file for the kernel reads what the disk holds
    (O_DIRECT, as its blocks were written), not pages in memory, and does not fill
    the page cache with a second copy of a file its reader has just read."""
    source = (dataset / SHARD).read_bytes()
    with mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        assert read_uncached(spoke.mountpoint / SHARD) == source
        wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
        [data_file] = [path for path in cache_data_files(spoke.cache_dir) if path.stat().st_size == len(source)]
        assert resident_pages(data_file) <= 1  # the short last block (17 bytes) went through the page cache
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}


def test_a_file_filled_in_the_background_is_verified_while_still_open(hub: HubProcess, dataset: Path,
                                                                     tmp_path: Path) -> None:
    """A loader reading a shard at random keeps it open all epoch: once the background fill has
    brought it whole it is verified then, not at its last release, and its next open is direct."""
    source = (dataset / SHARD).read_bytes()
    with mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        fd = os.open(spoke.mountpoint / SHARD, os.O_RDONLY)
        try:
            for blockno in (40, 3, 27, 12, 33):  # random reads: the file is filled in the background
                offset = blockno * TEST_BLOCK_SIZE + 5
                assert os.pread(fd, 100, offset) == source[offset : offset + 100]
            stats = wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
            assert stats["fetched_bytes"] >= len(source)
        finally:
            os.close(fd)
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}


def test_passthrough_is_the_default(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    source = (dataset / SHARD).read_bytes()
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--prefetch-siblings", "0")) as spoke:
        assert read_uncached(spoke.mountpoint / SHARD) == source
        wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}


def test_small_files_fetched_ahead_are_read_by_the_kernel_from_their_first_open(hub: HubProcess, dataset: Path,
                                                                              tmp_path: Path) -> None:
    """A small file is verified as it is written to the cache (its bytes were just checked
    against the hub's checksum): the siblings fetched ahead of their reads are read by the
    kernel from their data files at their first open, and the daemon stops holding them."""
    directory = "small/dir 1"
    names = sorted(os.listdir(dataset / directory))
    siblings = len(names) - 1  # the first file's open prefetches exactly the rest of its directory
    port = free_port()
    args = (*SPOKE_ARGS, "--prefetch-siblings", str(siblings), "--passthrough", "--metrics-listen", f"127.0.0.1:{port}")
    with mounted_spoke(hub.url, tmp_path, args) as spoke:
        assert read_uncached(spoke.mountpoint / directory / names[0]) == (dataset / directory / names[0]).read_bytes()
        wait_for_stats(spoke, lambda stats: stats["verified_files"] == len(names))
        # Sealed, every one (the reads below prefetch the next directory: not yet).
        assert {stat.S_IMODE(path.stat().st_mode) for path in cache_data_files(spoke.cache_dir)} == {0o400}
        before = spoke.stats()
        for name in names[1:]:
            assert read_uncached(spoke.mountpoint / directory / name) == (dataset / directory / name).read_bytes()
        after = spoke.stats()
        assert after["reads"] == before["reads"]
        assert after["passthrough_opens"] - before["passthrough_opens"] == siblings
        assert after["readahead_used"] - before["readahead_used"] == siblings  # read, by the kernel
        # Those reads prefetched the next directory, held for its reads; none of this one is held.
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == stats["fetched_bytes"])
        this_directory = sum((dataset / directory / name).stat().st_size for name in names)
        held = spoke_metrics(port)['cachefs_held_block_bytes{owner="read-ahead"}']
        # Counted after the scrape: a file of the next directory may arrive (fetched, then held) meanwhile.
        assert held <= spoke.stats()["fetched_bytes"] - this_directory


def test_with_no_passthrough_the_daemon_serves_every_read(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    source = (dataset / SHARD).read_bytes()
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--prefetch-siblings", "0", "--no-passthrough")) as spoke:
        assert read_uncached(spoke.mountpoint / SHARD) == source
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= len(source))
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved["passthrough_opens"] == 0 and moved["reads"] > 0
        assert spoke.stats()["verified_files"] == 0
        modes = {stat.S_IMODE(path.stat().st_mode) for path in cache_data_files(spoke.cache_dir)}
        assert modes == {0o600}  # never sealed: the daemon checks every read


def test_a_byte_changed_on_disk_after_verification_is_found_and_never_served_after(
        hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    """The kernel reads a verified file without a check, so its data file is sealed and
    re-verified on a period: a byte changed on disk afterwards (root ignores the seal, and
    so does a failing disk) is found, counted, and the file goes back to the daemon, which
    fetches the changed block again; the changed byte is never served after that."""
    source = (dataset / SHARD).read_bytes()
    with mounted_spoke(hub.url, tmp_path, (*ARGS, "--reverify-interval", "0.5")) as spoke:
        assert read_uncached(spoke.mountpoint / SHARD) == source
        wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}
        [data_file] = [path for path in cache_data_files(spoke.cache_dir) if path.stat().st_size == len(source)]
        assert stat.S_IMODE(data_file.stat().st_mode) == 0o400  # sealed
        wait_for_stats(spoke, lambda stats: stats["reverified_files"] >= 1)
        assert spoke.stats()["reverify_failures"] == 0
        offset = 7 * TEST_BLOCK_SIZE + 123
        with open(data_file, "r+b") as disk:
            disk.seek(offset)
            disk.write(bytes([source[offset] ^ 0xFF]))
        fetched = spoke.stats()["fetched_bytes"]
        stats = wait_for_stats(spoke, lambda stats: stats["reverify_failures"] == 1)
        assert stat.S_IMODE(data_file.stat().st_mode) == 0o600  # unsealed: the block is written again
        verified = stats["verified_files"]
        data, moved = _read_through_kernel(spoke, SHARD)  # by the daemon
        assert data == source
        assert moved["passthrough_opens"] == 0 and moved["reads"] > 0
        wait_for_stats(spoke, lambda stats: stats["verified_files"] > verified)
        data, moved = _read_through_kernel(spoke, SHARD)  # verified again: by the kernel
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}
        assert spoke.stats()["fetched_bytes"] - fetched == TEST_BLOCK_SIZE  # the changed block only
        assert spoke.stats()["reverify_failures"] == 1
        assert stats["corrupt_blocks"] == 0  # found by the re-verification, not by a read


def test_a_corrupt_block_is_never_handed_to_the_kernel(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    """A block corrupted on disk before its file was verified fails the
    verification: the file stays with the daemon (which refetches the block),
    and only once it verifies whole does the kernel read it directly."""
    source = (dataset / SHARD).read_bytes()
    cache_dir = tmp_path / "cache"
    with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
        assert read_uncached(spoke.mountpoint / SHARD, 0, 100) == source[:100]  # caches block 0 only
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == TEST_BLOCK_SIZE)
    [data_file] = cache_data_files(cache_dir)
    with open(data_file, "r+b") as corrupt:
        corrupt.seek(50)
        corrupt.write(bytes([source[50] ^ 0xFF]))
    with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
        rest = read_uncached(spoke.mountpoint / SHARD, TEST_BLOCK_SIZE)  # every block but the corrupt one
        assert rest == source[TEST_BLOCK_SIZE:]
        stats = wait_for_stats(spoke, lambda stats: stats["corrupt_blocks"] == 1)  # found by the verification
        assert stats["verified_files"] == 0
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved["passthrough_opens"] == 0 and moved["reads"] > 0
        wait_for_stats(spoke, lambda stats: stats["verified_files"] == 1)
        data, moved = _read_through_kernel(spoke, SHARD)
        assert data == source
        assert moved == {"reads": 0, "passthrough_opens": 1}


def test_eviction_leaves_a_file_the_kernel_reads_directly_whole(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    """While a file is open in passthrough mode its blocks are not evicted (a hole
    punched in its data file would read as zeros); once closed they may be."""
    source = (dataset / SHARD).read_bytes()
    others = ["shards/shard-001.bin", "shards/shard-002.bin", "shards/shard-003.bin", "shards/shard-004.bin"]
    limit = len(source) + 8 * TEST_BLOCK_SIZE  # the shard and a little more
    args = (*ARGS, "--cache-size", str(limit))
    with mounted_spoke(hub.url, tmp_path, args) as spoke:
        for offset in reversed(range(0, len(source), TEST_BLOCK_SIZE)):  # backwards: no read-ahead into other files
            assert read_uncached(spoke.mountpoint / SHARD, offset, TEST_BLOCK_SIZE) == source[offset : offset + TEST_BLOCK_SIZE]
        wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
        fd = os.open(spoke.mountpoint / SHARD, os.O_RDONLY)
        try:
            assert spoke.stats()["passthrough_opens"] == 1
            for _round in range(4):  # popular enough to displace the shard's blocks, were they not held
                for relative in others:
                    assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
            # the writer commits (and evicts for) the blocks it holds in batches, a little later
            wait_for_stats(spoke, lambda stats: stats["evicted_blocks"] + stats["rejected_blocks"] > 0)
            evict_from_page_cache(cache_data_files(spoke.cache_dir))
            assert os.pread(fd, len(source) + 1, 0) == source
        finally:
            os.close(fd)


def test_a_file_changed_by_a_refresh_while_open_directly_waits_for_its_old_opens(dataset: Path,
                                                                              tmp_path: Path) -> None:
    """The kernel allows one backing file per inode, and inode numbers survive a
    refresh: while the old version is open in passthrough mode, the old handle
    keeps reading the old bytes and a new open fails with ESTALE (never a mix);
    once it is closed, the new version opens and reads whole."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    changed = source / SHARD
    old_bytes = changed.read_bytes()
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        mounted = spoke.mountpoint / SHARD
        assert read_uncached(mounted) == old_bytes
        wait_for_stats(spoke, lambda stats: stats["verified_files"] >= 1)
        fd = os.open(mounted, os.O_RDONLY)
        try:
            assert spoke.stats()["passthrough_opens"] == 1
            new_bytes = os.urandom(len(old_bytes) - 1000)
            generation = hub_health(hub)["generation"]
            changed.write_bytes(new_bytes)
            hub.proc.send_signal(signal.SIGUSR1)
            wait_for_generation_change(hub, generation)
            assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
            with pytest.raises(OSError) as failure:
                os.open(mounted, os.O_RDONLY)
            assert failure.value.errno == errno.ESTALE
            assert os.pread(fd, len(old_bytes) + 1, 0) == old_bytes
        finally:
            os.close(fd)
        assert read_uncached(mounted) == new_bytes


# -- below the mount ---------------------------------------------------------------

BLOCK = 4096
FILE_ID, VERSION = b"\x01" * 8, b"\x02" * 8
LENGTHS = [BLOCK, BLOCK, 100]


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[BlockCache]:
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as opened:
        yield opened


def _insert_file(cache: BlockCache) -> list[BlockKey]:
    keys = [BlockKey(FILE_ID, VERSION, blockno) for blockno in range(len(LENGTHS))]
    blocks = [(key, bytes([key.blockno + 1]) * length, False) for key, length in zip(keys, LENGTHS, strict=True)]
    assert cache.insert_many(blocks) == 3
    return keys


def test_a_file_is_verified_only_whole_and_only_for_this_boot(cache: BlockCache, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, [*LENGTHS, BLOCK])]) == set()  # a block missing
    assert cache.verify_files([(FILE_ID, VERSION, [BLOCK, BLOCK, 99])]) == set()  # a length that does not match
    assert not cache.verified(FILE_ID, VERSION)
    marked = cache.verify_files([(b"\x09" * 8, VERSION, [BLOCK]), (FILE_ID, VERSION, LENGTHS)])  # one commit
    assert marked == {(FILE_ID, VERSION)}
    assert cache.verified(FILE_ID, VERSION)
    # Another boot (a power loss may have kept entries whose bytes never reached the disk).
    other_boot = tmp_path / "boot_id"
    other_boot.write_text("another boot\n")
    with monkeypatch.context() as patch:
        patch.setattr(block_cache_module, "BOOT_ID_PATH", other_boot)
        block_cache_module.boot_id.cache_clear()
        try:
            assert not cache.verified(FILE_ID, VERSION)
        finally:
            block_cache_module.boot_id.cache_clear()
    assert cache.verified(FILE_ID, VERSION)
    # Any change of a block's entry drops the mark.
    cache.remove(keys[1])
    assert not cache.verified(FILE_ID, VERSION)


def test_a_held_file_keeps_its_blocks_and_its_mark(cache: BlockCache) -> None:
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    assert cache.hold(FILE_ID, VERSION)
    cache.remove(keys[0])  # what eviction and a failed check do: skipped while held
    assert cache.contains(keys[0]) and cache.verified(FILE_ID, VERSION)
    cache.unhold(FILE_ID, VERSION)
    cache.remove(keys[0])
    assert not cache.contains(keys[0]) and not cache.verified(FILE_ID, VERSION)


def test_a_verified_data_file_is_sealed_and_only_a_drop_unseals_it(cache: BlockCache) -> None:
    keys = _insert_file(cache)
    path = cache.store.path(FILE_ID, VERSION)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    assert cache.insert_many([(keys[0], b"\xee" * BLOCK, True)]) == 0  # refused (root could write any mode)
    entry = cache.entry(keys[0])
    assert entry is not None and cache.read(keys[0], entry) == b"\x01" * BLOCK
    assert cache.verified(FILE_ID, VERSION)
    cache.remove(keys[0])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and not cache.verified(FILE_ID, VERSION)
    assert cache.insert_many([(keys[0], b"\x01" * BLOCK, False)]) == 1


@pytest.mark.parametrize("small", [False, True], ids=["read back", "small file as inserted"])
def test_a_block_dropped_while_its_file_is_sealed_leaves_the_file_unsealed(cache: BlockCache, small: bool) -> None:
    """The mark is committed, then the file sealed: a drop of one of its blocks in between
    (the cache writer's eviction, a corrupt read) unseals it before the seal, or (the cache
    writer's own insert, during which a drop waits for the cache lock) right after it. The
    file must end unsealed, so that the block can be cached again and the file verified again."""
    lengths = [100] if small else LENGTHS
    keys = [BlockKey(FILE_ID, VERSION, blockno) for blockno in range(len(lengths))]
    data = [bytes([blockno + 1]) * length for blockno, length in enumerate(lengths)]
    mark_verified, add = cache.index.mark_verified, cache.index.add
    droppers: list[threading.Thread] = []

    def then_dropped(commit: Callable[..., Any]) -> Callable[..., Any]:
        def commit_then_drop(*args: Any) -> Any:
            committed = commit(*args)
            dropper = threading.Thread(target=lambda: cache.remove(keys[0]))
            dropper.start()
            dropper.join(timeout=0.5)  # done now, unless it waits for the cache lock this thread holds
            droppers.append(dropper)
            return committed
        return commit_then_drop

    if small:
        cache.verify_small_files_on_insert(True)
        cache.index.add = then_dropped(add)  # type: ignore[method-assign]
        assert cache.insert_many([(keys[0], data[0], False)]) == 1
    else:
        assert cache.insert_many([(key, block, False) for key, block in zip(keys, data, strict=True)]) == len(keys)
        cache.index.mark_verified = then_dropped(mark_verified)  # type: ignore[method-assign]
        assert cache.verify_files([(FILE_ID, VERSION, lengths)]) == {(FILE_ID, VERSION)}
    for dropper in droppers:
        dropper.join()
    cache.index.mark_verified, cache.index.add = mark_verified, add  # type: ignore[method-assign]
    assert not cache.verified(FILE_ID, VERSION)
    assert stat.S_IMODE(os.stat(cache.store.path(FILE_ID, VERSION)).st_mode) == 0o600
    cache.verify_small_files_on_insert(False)
    assert cache.insert_many([(keys[0], data[0], False)]) == 1  # fetched again: cached again
    assert cache.verify_files([(FILE_ID, VERSION, lengths)]) == {(FILE_ID, VERSION)}


def test_a_small_file_is_verified_and_sealed_as_it_is_inserted(cache: BlockCache) -> None:
    """A file of one short block written through the page cache needs no read-back (it would
    read the pages just written): once passthrough is on, inserting it verifies and seals it."""
    small = BlockKey(b"\x03" * 8, VERSION, 0)
    cache.insert_many([(small, b"\x05" * 100, False)])
    assert not cache.verified(small.file_id, VERSION)  # passthrough off: nothing is marked
    cache.verify_small_files_on_insert(True)
    other = BlockKey(b"\x04" * 8, VERSION, 0)
    whole_block = BlockKey(b"\x06" * 8, VERSION, 0)  # a file of one full block, or the first of several
    keys = _insert_file(cache)  # a file of three blocks, its last short
    assert cache.insert_many([(other, b"\x07" * 100, False), (whole_block, b"\x08" * BLOCK, False)]) == 2
    assert cache.verified(other.file_id, VERSION)
    assert stat.S_IMODE(os.stat(cache.store.path(other.file_id, VERSION)).st_mode) == 0o400
    assert not cache.verified(whole_block.file_id, VERSION) and not cache.verified(FILE_ID, VERSION)
    assert stat.S_IMODE(os.stat(cache.store.path(FILE_ID, VERSION)).st_mode) == 0o600
    entry = cache.entry(other)
    assert entry is not None and cache.read(other, entry) == b"\x07" * 100
    # Its mark is dropped as any other: by a change of its entry, which unseals it first.
    cache.remove(other)
    assert not cache.verified(other.file_id, VERSION)
    assert stat.S_IMODE(os.stat(cache.store.path(other.file_id, VERSION)).st_mode) == 0o600
    # A file verified already is not read back by the background verification.
    assert cache.insert_many([(small, b"\x05" * 100, False)]) == 1
    cache.remove(keys[2])
    read_back = []
    store_read = cache.store.read
    cache.store.read = lambda *args, **kwargs: read_back.append(args[0]) or store_read(*args, **kwargs)  # type: ignore[method-assign]
    assert cache.verify_files([(small.file_id, VERSION, [100])]) == set()
    assert read_back == []
    cache.verify_small_files_on_insert(False)
    assert cache.insert_many([(keys[2], b"\x03" * 100, False)]) == 1  # the last block of a larger file
    assert not cache.verified(FILE_ID, VERSION)


def test_reverification_finds_a_changed_block_in_steps_and_drops_only_it(cache: BlockCache) -> None:
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    assert cache.reverify_blocks(FILE_ID, VERSION, 0, 1 << 30) == (None, sum(LENGTHS), [])
    with open(cache.store.path(FILE_ID, VERSION), "r+b") as disk:
        disk.seek(BLOCK + 5)
        disk.write(b"\xff")
    assert cache.reverify_blocks(FILE_ID, VERSION, 0, BLOCK) == (1, BLOCK, [])  # a step of about BLOCK bytes
    assert cache.reverify_blocks(FILE_ID, VERSION, 1, BLOCK) == (2, BLOCK, [keys[1]])
    assert cache.reverify_blocks(FILE_ID, VERSION, 2, BLOCK) == (None, 100, [])
    [(file_id, version, verified_at_s)] = cache.verified_versions()
    assert (file_id, version) == (FILE_ID, VERSION) and abs(verified_at_s - time.time()) < 60
    cache.drop_changed([keys[1]])
    assert cache.verified_versions() == [] and not cache.verified(FILE_ID, VERSION)
    assert [cache.contains(key) for key in keys] == [True, False, True]
    assert stat.S_IMODE(os.stat(cache.store.path(FILE_ID, VERSION)).st_mode) == 0o600


def _in_another_thread(work: Callable[[], object]) -> None:
    """Run `work` on another OS thread, as the cache writer or an operator's evict would, and wait for it."""
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


@pytest.mark.parametrize("drop", ["evicted", "evicted by the operator"])
def test_a_block_dropped_while_reverified_is_no_change_on_disk(cache: BlockCache, drop: str) -> None:
    """A full cache evicts verified files too: a block dropped between the step's index read
    and its disk read reads as a hole (or a missing file), which is no change on disk."""
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    store_read = cache.store.read

    def read_after_the_drop(key: BlockKey, *args: Any, **kwargs: Any) -> Any:
        if key == keys[1]:
            if drop == "evicted by the operator":
                _in_another_thread(lambda: cache.evict_file(FILE_ID))
            else:
                _in_another_thread(lambda: cache.remove(keys[1]))
        return store_read(key, *args, **kwargs)

    cache.store.read = read_after_the_drop  # type: ignore[method-assign]
    assert cache.reverify_blocks(FILE_ID, VERSION, 0, 1 << 30) == (None, sum(LENGTHS), [])


class _Revoked:
    """What the reverifier tells passthrough."""

    enabled = True

    def __init__(self) -> None:
        self.files: list[tuple[bytes, bytes]] = []

    def revoke(self, file_id: bytes, version: bytes) -> None:
        self.files.append((file_id, version))


class _HeldCopies:
    """What the reverifier tells the fetcher: the blocks it must not serve from memory."""

    def __init__(self) -> None:
        self.predicates: list[Callable[[BlockKey], bool]] = []

    def discard_pending(self, predicate: Callable[[BlockKey], bool]) -> None:
        self.predicates.append(predicate)


def test_a_file_is_reverified_a_period_after_its_last_verification_even_across_restarts(cache: BlockCache) -> None:
    """The time of a file's last verification is in the index, so a daemon started
    since (a new Reverifier) re-hashes it when it is due, not a period after its start."""
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    stats, revoked, held = Stats(), _Revoked(), _HeldCopies()

    def one_round() -> None:
        reverifier = Reverifier(cache, revoked, held, stats, interval_s=3600, rate_bytes=1 << 30)
        trio.run(reverifier.run_round)

    one_round()
    assert stats.reverified_files == 0  # verified just now: not due
    cache.index.reverified(FILE_ID, VERSION, boot_id(), time.time() - 3601)  # as if verified before a restart
    one_round()
    assert (stats.reverified_files, stats.reverify_failures) == (1, 0)
    one_round()
    assert stats.reverified_files == 1  # its period starts again
    with open(cache.store.path(FILE_ID, VERSION), "r+b") as disk:
        disk.seek(2 * BLOCK + 99)
        disk.write(b"\x00")
    cache.index.reverified(FILE_ID, VERSION, boot_id(), time.time() - 3601)
    one_round()
    assert (stats.reverified_files, stats.reverify_failures) == (2, 1)
    assert revoked.files == [(FILE_ID, VERSION)]
    assert not cache.verified(FILE_ID, VERSION)
    assert [cache.contains(key) for key in keys] == [True, True, False]
    # a copy of the changed block held in memory is dropped too: the next read fetches it and caches it again
    [discarded] = held.predicates
    assert [discarded(key) for key in keys] == [False, False, True]


@dataclasses.dataclass
class _Plans:
    is_active: bool = False

    def active(self) -> bool:
        return self.is_active


def _verifying_passthrough(cache: BlockCache, monkeypatch: pytest.MonkeyPatch, delay_s: float, *,
                           plan_active: bool = False) -> tuple[Passthrough, Stats, Inode]:
    """A Passthrough that verifies after `delay_s` (no kernel support needed), its stats, and the test file's inode."""
    monkeypatch.setattr(passthrough_module, "VERIFY_DELAY_S", delay_s)
    stats = Stats()
    passthrough = Passthrough(cache, _Plans(plan_active), stats, mode=PassthroughMode.AUTO)
    passthrough.enabled = True
    inode = Inode(ino=5, kind=KIND_FILE, mode=0o644, mtime_ns=0, size=sum(LENGTHS), parent=1,
                  file_id=FILE_ID, version=VERSION)
    return passthrough, stats, inode


@pytest.mark.trio
@pytest.mark.parametrize("removal", ["evict", "purge", "stale version"])
async def test_an_open_never_hands_the_kernel_a_data_file_made_after_its_check(
        cache: BlockCache, monkeypatch: pytest.MonkeyPatch, removal: str) -> None:
    """A hold keeps a file's blocks, not its path: an operator's evict (or a purge, or a
    refresh dropping a stale version) removes the data file between the open's verified
    check and its opening it, and the cache writer starts a new one at that path with the
    file's last block. That file has the right size and holes: it is served by the daemon."""
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    handed: list[bytes] = []
    monkeypatch.setattr(passthrough_module, "_register_backing", lambda fd: handed.append(os.pread(fd, 1 << 20, 0)) or 7)
    passthrough, _stats, inode = _verifying_passthrough(cache, monkeypatch, 1.0)
    remove = {"evict": lambda: cache.evict_file(FILE_ID), "purge": cache.purge,
              "stale version": lambda: cache.drop_versions([keys])}[removal]
    verified = cache.verified
    new_sizes = []

    def verified_then_removed(file_id: bytes, version: bytes) -> bool:
        answer = verified(file_id, version)
        _in_another_thread(remove)
        _in_another_thread(lambda: cache.insert_many([(keys[2], b"\x03" * LENGTHS[2], False)]))  # the writer
        new_sizes.append(os.path.getsize(cache.store.path(FILE_ID, VERSION)))
        return answer

    cache.verified = verified_then_removed  # type: ignore[method-assign]
    assert passthrough.open(inode) == 0 and handed == []  # served by the daemon, which checks every read
    assert new_sizes == [sum(LENGTHS)]  # the new data file: as large as the file, with holes
    passthrough.release(inode)
    cache.verified = verified  # type: ignore[method-assign]
    assert passthrough.open(inode) == 0  # not whole any more: still the daemon
    passthrough.release(inode)


def _failing_once(commit: Callable[..., Any]) -> Callable[..., Any]:
    """An index write whose first commit fails as on a full disk (LMDB raises; nothing is written)."""
    calls = []

    def commit_or_fail(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == 1:
            raise lmdb.DiskError("No space left on device")
        return commit(*args)
    return commit_or_fail


@pytest.mark.trio
async def test_a_verification_the_index_cannot_record_is_tried_again_and_the_mount_goes_on(
        cache: BlockCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _insert_file(cache)
    passthrough, stats, inode = _verifying_passthrough(cache, monkeypatch, 0.01)
    monkeypatch.setattr(cache.index, "mark_verified", _failing_once(cache.index.mark_verified))
    assert passthrough.open(inode) == 0
    passthrough.release(inode)
    async with trio.open_nursery() as nursery:
        await nursery.start(passthrough.run_verifier)
        for _ in range(500):  # 5 s at most; looked at again after 0.02 s
            if cache.verified(FILE_ID, VERSION):
                break
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert stats.verified_files == 1 and "No space left on device" in caplog.text
    assert stat.S_IMODE(os.stat(cache.store.path(FILE_ID, VERSION)).st_mode) == 0o400


def test_a_changed_file_whose_mark_the_index_cannot_drop_is_no_longer_verified(
        cache: BlockCache, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The index cannot commit the drop of a changed block (a full disk): the file must not
    be handed to the kernel again all the same, and the next round drops the block."""
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    with open(cache.store.path(FILE_ID, VERSION), "r+b") as disk:
        disk.seek(5)
        disk.write(b"\xff")
    monkeypatch.setattr(cache.index, "remove_many", _failing_once(cache.index.remove_many))
    passthrough, stats, inode = _verifying_passthrough(cache, monkeypatch, 1.0)
    reverifier = Reverifier(cache, passthrough, _HeldCopies(), stats, interval_s=3600, rate_bytes=1 << 30)
    cache.index.reverified(FILE_ID, VERSION, boot_id(), time.time() - 3601)  # due
    trio.run(reverifier.run_round)
    assert stats.reverify_failures == 1 and "No space left on device" in caplog.text
    assert cache.contains(keys[0]) and not cache.verified(FILE_ID, VERSION)  # still indexed, not trusted
    assert cache.hold(FILE_ID, VERSION)
    assert passthrough._backing_id(inode) == 0  # served by the daemon, which checks every read
    trio.run(reverifier.run_round)  # still due: found again, and dropped this time
    assert stats.reverify_failures == 2 and not cache.contains(keys[0])
    assert stat.S_IMODE(os.stat(cache.store.path(FILE_ID, VERSION)).st_mode) == 0o600


@pytest.mark.trio
async def test_a_file_whose_last_block_reaches_the_cache_late_is_verified_once_it_does(
        cache: BlockCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded machine's cache writer can be seconds behind a file's release: the file found
    incomplete is looked at again (before, it waited for its next open and release)."""
    passthrough, stats, inode = _verifying_passthrough(cache, monkeypatch, 0.05)
    keys = [BlockKey(FILE_ID, VERSION, blockno) for blockno in range(len(LENGTHS))]
    blocks = [(key, bytes([key.blockno + 1]) * length, False) for key, length in zip(keys, LENGTHS, strict=True)]
    assert cache.insert_many(blocks[:2]) == 2  # the last block is still on its way
    assert passthrough.open(inode) == 0
    passthrough.release(inode)
    async with trio.open_nursery() as nursery:
        await nursery.start(passthrough.run_verifier)
        await trio.sleep(0.08)  # looked at once, found incomplete
        assert stats.verified_files == 0
        assert cache.insert_many(blocks[2:]) == 1
        for _ in range(250):  # 5 s at most
            if cache.verified(FILE_ID, VERSION):
                break
            await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert stats.verified_files == 1


@pytest.mark.trio
async def test_a_release_of_a_file_verified_already_reads_nothing_back(
        cache: BlockCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opens the daemon serves (here: a plan is active) queue their file for verification at
    release; one verified already is neither read back again nor counted again."""
    passthrough, stats, inode = _verifying_passthrough(cache, monkeypatch, 0.01, plan_active=True)
    _insert_file(cache)
    checked: list[list[tuple[bytes, bytes, list[int]]]] = []
    verify_files = cache.verify_files
    monkeypatch.setattr(cache, "verify_files", lambda files: checked.append(files) or verify_files(files))
    async with trio.open_nursery() as nursery:
        await nursery.start(passthrough.run_verifier)
        for _round in range(2):
            assert passthrough.open(inode) == 0
            passthrough.release(inode)
            await trio.sleep(0.2)  # due, verified (or found verified), and any retry due too
        nursery.cancel_scope.cancel()
    assert cache.verified(FILE_ID, VERSION) and stats.verified_files == 1
    assert checked == [[(FILE_ID, VERSION, LENGTHS)]]


@pytest.mark.trio
async def test_a_file_verified_while_it_waited_is_not_handed_to_a_worker_thread(
        cache: BlockCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small file is mostly released before the cache writer verifies it as it inserts it:
    queued then, it is found verified at its turn, and no worker thread looks at it again."""
    passthrough, stats, inode = _verifying_passthrough(cache, monkeypatch, 0.05)
    assert passthrough.open(inode) == 0  # nothing cached yet: served by the daemon
    passthrough.release(inode)  # queued for verification
    _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}  # as the writer marks a small file
    handed: list[object] = []
    monkeypatch.setattr(passthrough, "_verify", lambda inodes: handed.append(inodes) or set())
    async with trio.open_nursery() as nursery:
        await nursery.start(passthrough.run_verifier)
        await trio.sleep(0.3)  # due, and any retry due too
        nursery.cancel_scope.cancel()
    assert handed == []
    assert stats.verified_files == 0  # counted by the writer's path, not again here


def test_a_corrupt_block_s_drop_and_a_new_write_of_it_never_leave_a_hole_behind_an_entry(
    cache: BlockCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read finds a cached block corrupt and drops it (entry, unseal, then a hole punched)
    while the cache writer caches the block again: the write waits for the whole drop, else
    the drop punched out the new bytes behind the new entry."""
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    good = bytes([2]) * BLOCK
    path = cache.store.path(FILE_ID, VERSION)
    with open(path, "r+b") as data_file:  # root writes into a sealed file
        data_file.seek(BLOCK)
        data_file.write(b"\xff" * 16)
    writer = threading.Thread(target=lambda: cache.insert_many([(keys[1], good, True)]))
    punch_hole = store_module.punch_hole

    def punch_while_the_writer_caches_it_again(fd: int, offset: int, length: int) -> None:
        if writer.ident is None:
            writer.start()
            writer.join(timeout=0.5)  # the writer has the block cached again now, unless it waits for the drop
        punch_hole(fd, offset, length)

    monkeypatch.setattr(store_module, "punch_hole", punch_while_the_writer_caches_it_again)
    entry = cache.entry(keys[1])
    assert entry is not None and cache.read(keys[1], entry) is None  # found corrupt, dropped
    writer.join()
    entry = cache.entry(keys[1])
    assert entry is not None, "the writer's block is cached"
    data = cache.read(keys[1], entry)
    assert data is not None and bytes(data) == good


def test_a_sealed_data_file_whose_verification_is_gone_takes_its_blocks_again(cache: BlockCache) -> None:
    """A crash between a drop's index commit and its unseal leaves a sealed data file whose
    blocks and mark are gone from the index: its blocks are cached again when fetched
    again, else the file would be read from the hub for good. A verified file's stays
    refused."""
    keys = _insert_file(cache)
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
    assert cache.insert_many([(keys[0], bytes([1]) * BLOCK, True)]) == 0  # verified: refused
    cache.index.remove_many(keys)  # the drop's commit, then the crash: the file stays sealed
    assert stat.S_IMODE(os.stat(cache.store.path(FILE_ID, VERSION)).st_mode) == 0o400
    blocks = [(key, bytes([key.blockno + 1]) * length, False) for key, length in zip(keys, LENGTHS, strict=True)]
    assert cache.insert_many(blocks) == 3
    assert cache.verify_files([(FILE_ID, VERSION, LENGTHS)]) == {(FILE_ID, VERSION)}
