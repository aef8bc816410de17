"""Reads through a real FUSE mount over a real hub compare byte for byte with the source."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import pytest
from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE, source_files
from fault_proxy import running_fault_proxy
from hub_helpers import fetch_manifest, hub_env, running_hub, sample, scrape_metrics, wait_until
from mount_helpers import (
    SpokeMount,
    cache_data_files,
    cache_disk_bytes,
    cachefs_command,
    evict_from_page_cache,
    is_mounted,
    mount_spoke,
    mounted_spoke,
    read_uncached,
    resident_pages,
    run_cachefs,
    wait_for_stats,
)

from cachefs.cache.block_cache import CHUNK_BYTES
from cachefs.config import READAHEAD_RUNS_IN_FLIGHT, MountConfig, parse_hub_url
from cachefs.daemon import FUSECTL_DIR
from cachefs.processes import wait_for_pid


def test_every_file_reads_back_identical(spoke: SpokeMount, dataset: Path) -> None:
    files = source_files(dataset)
    assert len(files) > 100
    for relative in files:
        assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes(), relative
    stats = spoke.stats()
    assert stats["fetched_bytes"] == sum((dataset / f).stat().st_size for f in files)


def test_random_ranges_cross_block_boundaries_and_eof(spoke: SpokeMount, dataset: Path) -> None:
    rng = random.Random(1)
    shards = sorted((dataset / "shards").iterdir())
    for _ in range(300):
        shard = rng.choice(shards)
        size = shard.stat().st_size
        boundary = rng.randrange(0, size // TEST_BLOCK_SIZE + 1) * TEST_BLOCK_SIZE
        offset = max(0, boundary + rng.randrange(-300, 300))
        length = rng.choice([1, 17, 4096, TEST_BLOCK_SIZE, 3 * TEST_BLOCK_SIZE + 5, 700_000])
        expected = shard.read_bytes()[offset : offset + length]
        got = read_uncached(spoke.mountpoint / "shards" / shard.name, offset, length)
        assert got == expected, (shard.name, offset, length)
    # Reads at and past the end of a file return nothing.
    size = shards[0].stat().st_size
    assert read_uncached(spoke.mountpoint / "shards" / shards[0].name, size, 100) == b""
    assert read_uncached(spoke.mountpoint / "shards" / shards[0].name, size + 10_000, 100) == b""


def test_the_mount_raises_the_kernel_readahead_and_fuse_background_limit(spoke: SpokeMount) -> None:
    """Big FUSE read requests and more of them in flight: read_ahead_kb and the
    FUSE connection's max_background are raised before the mount is ready."""
    config = MountConfig(hub_url=parse_hub_url("http://127.0.0.1:1"), mountpoint=spoke.mountpoint, cache_dir=spoke.cache_dir)
    device = os.stat(spoke.mountpoint).st_dev
    major, minor = os.major(device), os.minor(device)
    assert Path(f"/sys/class/bdi/{major}:{minor}/read_ahead_kb").read_text().strip() == str(config.kernel_readahead_kb)
    connection = FUSECTL_DIR / str(major << 20 | minor)
    assert (connection / "max_background").read_text().strip() == str(config.fuse_max_background)
    assert int((connection / "congestion_threshold").read_text()) == config.fuse_max_background * 3 // 4


def test_eight_concurrent_readers(spoke: SpokeMount, dataset: Path) -> None:
    files = source_files(dataset)
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            relative = rng.choice(files)
            source = (dataset / relative).read_bytes()
            offset = rng.randrange(0, max(1, len(source)))
            length = rng.randrange(1, 400_000)
            got = read_uncached(spoke.mountpoint / relative, offset, length)
            if got != source[offset : offset + length]:
                errors.append(f"{relative} at {offset}+{length}")

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a reader hung"
    assert errors == []


def test_concurrent_misses_of_one_block_fetch_it_once(hub, tmp_path: Path, dataset: Path) -> None:
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--readahead-blocks", "0")) as spoke:
        target = spoke.mountpoint / "shards" / "shard-001.bin"
        expected = (dataset / "shards" / "shard-001.bin").read_bytes()[:4096]
        barrier = threading.Barrier(8)
        results: list[bytes] = []

        def read() -> None:
            fd = os.open(target, os.O_RDONLY | os.O_DIRECT)
            try:
                barrier.wait(timeout=30)
                results.append(os.pread(fd, 4096, 0))
            finally:
                os.close(fd)

        threads = [threading.Thread(target=read) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == [expected] * 8
        assert spoke.stats()["fetches"] == 1


def test_tree_and_attributes_match_source(spoke: SpokeMount, dataset: Path) -> None:
    def tree(root: Path) -> dict[str, tuple[object, ...]]:
        entries = {}
        for directory, dirs, files in os.walk(root):
            for name in dirs + files:
                path = Path(directory) / name
                info = path.lstat()
                kind = stat.S_IFMT(info.st_mode)
                size = info.st_size if not stat.S_ISDIR(info.st_mode) else None
                target = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
                entries[str(path.relative_to(root))] = (kind, stat.S_IMODE(info.st_mode), size, info.st_mtime_ns, target)
        return entries

    assert tree(spoke.mountpoint) == tree(dataset)
    # Symlinks resolve inside the mount.
    assert (spoke.mountpoint / "link-to-shard").read_bytes() == (dataset / "shards" / "shard-000.bin").read_bytes()
    assert sorted(os.listdir(spoke.mountpoint / "link-to-dir")) == ["c"]


def test_metadata_needs_no_hub_after_mount(dataset: Path, tmp_path: Path) -> None:
    with running_hub(dataset) as hub, mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        hub.stop()
        names = sorted(str(Path(d).relative_to(spoke.mountpoint) / n) for d, ds, fs in os.walk(spoke.mountpoint) for n in ds + fs)
        expected = sorted(str(Path(d).relative_to(dataset) / n) for d, ds, fs in os.walk(dataset) for n in ds + fs)
        assert names == expected
        assert (spoke.mountpoint / "shards" / "shard-002.bin").stat().st_size == TEST_BLOCK_SIZE


def test_remount_with_hub_stopped_serves_cached_blocks(dataset: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    read_before = ["shards/shard-000.bin", "small/dir 1/file-03.dat", "naïve café ☕.txt"]
    with running_hub(dataset) as hub:
        with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
            for relative in read_before:
                assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
        url = hub.url
    # The hub is gone now: the second mount works from the cached manifest and blocks.
    with mounted_spoke(url, tmp_path, (*SPOKE_ARGS, "--fetch-timeout", "1"), cache_dir=cache_dir) as spoke:
        for relative in read_before:
            assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        assert spoke.stats()["fetches"] == 0
        # Data never read before cannot be had: a clean EIO, bounded in time. (Not
        # shard-001: read-ahead of shard-000 went on into it, the next file in tree order.)
        with pytest.raises(OSError) as failure:
            read_uncached(spoke.mountpoint / "shards" / "shard-004.bin")
        assert failure.value.errno == errno.EIO
        assert "offline" in spoke.log_text()


def test_a_cache_dir_with_the_namespace_in_its_block_index_is_moved_and_mounts_offline(
    dataset: Path, tmp_path: Path
) -> None:
    """Older versions kept the namespace in index.lmdb: it is moved out once, nothing is lost
    (the mount comes up offline on it, with its cached blocks)."""
    cache_dir = tmp_path / "cache"
    relative = "shards/shard-000.bin"
    with running_hub(dataset) as hub:
        with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
            assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
            wait_for_stats(spoke, lambda stats: stats["cached_bytes"] > 0)
            listing = sorted(os.listdir(spoke.mountpoint / "small"))
        url = hub.url
    # The layout an older cachefs left; then a move cut short after its rename (both hold a namespace).
    for keep_namespace in (False, True):
        move_namespace_into_index(cache_dir, keep_namespace)
        with mounted_spoke(url, tmp_path, (*SPOKE_ARGS, "--fetch-timeout", "1"), cache_dir=cache_dir) as spoke:
            assert sorted(os.listdir(spoke.mountpoint / "small")) == listing
            assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
            assert spoke.stats()["fetches"] == 0
            assert ("moved the namespace out of the block index" in spoke.log_text()) is not keep_namespace
            (cache_dir / "cachefs.log").unlink()
        env = lmdb.open(str(cache_dir / "index.lmdb"), max_dbs=16)
        with env.begin() as txn:
            tables = {key for key, _ in txn.cursor()}
            generation = txn.get(b"generation", db=env.open_db(b"meta", txn=txn))
        env.close()
        assert tables == {b"meta", b"blocks", b"fifo", b"pins", b"verified"} and generation is None


def move_namespace_into_index(cache_dir: Path, keep_namespace: bool = False) -> None:
    """Put the namespace's tables and settings into index.lmdb, and remove namespace.lmdb (or keep it)."""
    namespace = lmdb.open(str(cache_dir / "namespace.lmdb"), max_dbs=16)
    index = lmdb.open(str(cache_dir / "index.lmdb"), max_dbs=16, map_size=1 << 40)
    with namespace.begin() as source, index.begin(write=True) as target:
        for table in (b"inodes", b"names", b"dirents", b"loading"):
            items = list(source.cursor(db=namespace.open_db(table, txn=source)))
            target.cursor(db=index.open_db(table, txn=target)).putmulti(items)
        meta = list(source.cursor(db=namespace.open_db(b"meta", txn=source)))
        assert {key for key, _ in meta} >= {b"generation", b"entries", b"file_bytes"}
        target.cursor(db=index.open_db(b"meta", txn=target)).putmulti(meta)
    namespace.close()
    index.close()
    if not keep_namespace:
        shutil.rmtree(cache_dir / "namespace.lmdb")


def test_changes_are_refused_with_erofs(spoke: SpokeMount) -> None:
    root = spoke.mountpoint
    attempts = [
        lambda: open(root / "with space.txt", "r+b"),
        lambda: open(root / "new-file", "wb"),
        lambda: os.mkdir(root / "new-dir"),
        lambda: os.unlink(root / "empty.bin"),
        lambda: os.rmdir(root / "empty-dir"),
        lambda: os.rename(root / "empty.bin", root / "renamed.bin"),
        lambda: os.symlink("x", root / "new-link"),
        lambda: os.chmod(root / "empty.bin", 0o777),
        lambda: os.truncate(root / "with space.txt", 0),
        lambda: os.setxattr(root / "empty.bin", "user.x", b"1"),
    ]
    for attempt in attempts:
        with pytest.raises(OSError) as failure:
            attempt()
        assert failure.value.errno == errno.EROFS
    assert (root / "with space.txt").read_text() == "a name with a space\n"


def test_default_block_size_reads_identical(hub, dataset: Path, tmp_path: Path) -> None:
    with mounted_spoke(hub.url, tmp_path) as spoke:
        for relative in ["shards/shard-000.bin", "shards/shard-001.bin", "empty.bin"]:
            assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        assert spoke.stats()["block_size_bytes"] == 1 << 20


def test_cache_stays_under_its_size_limit(hub, dataset: Path, tmp_path: Path) -> None:
    limit = 8 * TEST_BLOCK_SIZE
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--cache-size", str(limit))) as spoke:
        relative = "shards/shard-000.bin"
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        # Displaced or not admitted, once the cache's writer has had the blocks (it commits after serving).
        stats = wait_for_stats(spoke, lambda stats: stats["evicted_blocks"] + stats["rejected_blocks"] > 0)
        assert stats["cached_bytes"] <= limit
        assert cache_disk_bytes(spoke.cache_dir) <= limit + 4096 * len(cache_data_files(spoke.cache_dir))
        # Evicted blocks are fetched again, still correct.
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()


def test_corrupt_cached_block_is_dropped_and_refetched(hub, dataset: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    relative = "shards/shard-002.bin"
    # Exactly one block gets cached; the daemon checks every read (with passthrough a file changed on disk
    # after its verification is found by re-verification instead: test_passthrough.py).
    args = (*SPOKE_ARGS, "--prefetch-siblings", "0", "--no-passthrough")
    with mounted_spoke(hub.url, tmp_path, args, cache_dir=cache_dir) as spoke:
        assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
    [block_file] = cache_data_files(cache_dir)
    data = bytearray(block_file.read_bytes())
    data[1000] ^= 0xFF
    block_file.write_bytes(bytes(data))
    with mounted_spoke(hub.url, tmp_path, args, cache_dir=cache_dir) as spoke:
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        stats = spoke.stats()
        assert stats["corrupt_blocks"] == 1
        assert stats["fetches"] == 1


def test_small_reads_verify_the_chunks_they_read(hub, dataset: Path, tmp_path: Path) -> None:
    """A small random read of a cached block reads and checks only its chunk (CHUNK_BYTES):
    a flipped byte in another chunk goes unnoticed by it, the read of the flipped
    chunk drops the block and refetches it, and no wrong byte is ever returned."""
    cache_dir = tmp_path / "cache"
    relative = "shards/shard-000.bin"  # 3 MiB: blocks of 1 MiB, 64 chunks each
    source = (dataset / relative).read_bytes()
    args = ("--fetch-timeout", "5", "--prefetch-siblings", "0", "--no-passthrough")  # the daemon's reads are tested
    with mounted_spoke(hub.url, tmp_path, args, cache_dir=cache_dir) as spoke:
        assert (spoke.mountpoint / relative).read_bytes() == source
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == len(source))
    [block_file] = cache_data_files(cache_dir)
    flipped = 3 * CHUNK_BYTES + 100  # chunk 3 of block 0
    with open(block_file, "r+b") as data_file:
        data_file.seek(flipped)
        byte = data_file.read(1)
        data_file.seek(flipped)
        data_file.write(bytes([byte[0] ^ 0xFF]))
    with mounted_spoke(hub.url, tmp_path, args, cache_dir=cache_dir) as spoke:
        path = spoke.mountpoint / relative
        assert read_uncached(path, 5000, 4096) == source[5000:9096]  # chunk 0: clean
        assert spoke.stats()["corrupt_blocks"] == 0
        assert read_uncached(path, flipped - 50, 4096) == source[flipped - 50 : flipped - 50 + 4096]
        stats = spoke.stats()
        assert stats["corrupt_blocks"] == 1
        assert stats["fetches"] == 1
        assert read_uncached(path) == source


@contextlib.contextmanager
def remounted_with_shard_cached(
    url: str, dataset: Path, tmp_path: Path, cache_dir: Path
) -> Iterator[tuple[SpokeMount, Path, bytes]]:
    """Cache a 3 MiB shard (three 1 MiB blocks) through one mount, then yield a fresh mount of
    the same cache dir (nothing in its memory), the shard's path in it and the source's bytes."""
    relative = "shards/shard-000.bin"
    source = (dataset / relative).read_bytes()
    args = ("--fetch-timeout", "5", "--prefetch-siblings", "0", "--no-passthrough")  # the daemon's reads are tested
    with mounted_spoke(url, tmp_path, args, cache_dir=cache_dir) as spoke:
        assert (spoke.mountpoint / relative).read_bytes() == source
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == len(source))
    with mounted_spoke(url, tmp_path, args, cache_dir=cache_dir) as spoke:
        yield spoke, spoke.mountpoint / relative, source


def test_cached_bytes_read_back_from_disk(hub, dataset: Path, tmp_path: Path) -> None:
    """With the cache's data files out of the page cache, small reads read their
    chunks on the event loop's thread (worker threads if the disk is slow),
    whole blocks in worker threads, and all return the source's bytes without
    asking the hub again."""
    cache_dir = tmp_path / "cache"
    with remounted_with_shard_cached(hub.url, dataset, tmp_path, cache_dir) as (spoke, path, source):
        rng = random.Random(3)
        for _ in range(40):
            evict_from_page_cache(cache_data_files(cache_dir))
            offset = rng.randrange(len(source) // 4096 - 1) * 4096
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # exactly this 4 KiB read reaches the daemon
            try:
                assert os.pread(fd, 4096, offset) == source[offset : offset + 4096], offset
            finally:
                os.close(fd)
        small = spoke.stats()
        # The first read at least found its chunk on disk only (later ones may find chunks the
        # data file's readahead brought in) and was read inline (a slow disk sends later ones to threads).
        assert small["disk_reads"] >= 1
        assert small["disk_reads_inline"] >= 1
        time.sleep(0.5)  # let readahead the small reads started end
        assert evict_from_page_cache(cache_data_files(cache_dir))
        assert read_uncached(path) == source
        whole = spoke.stats()
        assert whole["disk_reads"] - whole["disk_reads_inline"] > small["disk_reads"] - small["disk_reads_inline"]
        assert whole["fetches"] == 0


def test_a_cache_on_a_file_system_that_refuses_nowait_reads_serves_its_blocks(
    hub, dataset: Path, tmp_path: Path, tmpfs_dir: Path
) -> None:
    """tmpfs answers RWF_NOWAIT reads with EOPNOTSUPP: cached blocks are then read
    in worker threads, never dropped as corrupt and fetched again."""
    cache_dir = tmpfs_dir / "cache"
    with remounted_with_shard_cached(hub.url, dataset, tmp_path, cache_dir) as (spoke, path, source):
        assert read_uncached(path) == source
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # small reads: only their chunks
        try:
            for offset in (4096, len(source) // 2, len(source) - 8192):
                assert os.pread(fd, 4096, offset) == source[offset : offset + 4096], offset
        finally:
            os.close(fd)
        stats = spoke.stats()
        assert stats["corrupt_blocks"] == 0
        assert stats["fetches"] == 0
        assert "cannot read without waiting" in spoke.log_text()


def test_small_files_come_in_batches(dataset: Path, tmp_path: Path) -> None:
    """Reading a directory of small files costs a few batch requests, not one request per file,
    and each file's checksum comes with it (no checksum requests)."""
    with running_hub(dataset) as hub, mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        before = scrape_metrics(hub)
        small = sorted((dataset / "small" / "dir 1").iterdir())
        for path in small:
            assert (spoke.mountpoint / path.relative_to(dataset)).read_bytes() == path.read_bytes()
        after = scrape_metrics(hub)
        stats = spoke.stats()

    def requests(endpoint: str, status: str) -> float:
        name = "cachefs_hub_requests_total"
        return sample(after, name, endpoint=endpoint, status=status) - sample(before, name, endpoint=endpoint, status=status)

    assert requests("files", "206") + requests("files", "200") <= 2  # the first file, on demand
    assert requests("batch", "200") >= 1
    assert requests("checksums", "200") == 0
    assert stats["block_misses"] <= 2 and stats["readahead_fetches"] >= len(small) - 1
    # Many files per request (read-ahead went on past this directory too).
    assert stats["fetches"] <= stats["readahead_fetches"] // 4 + 2


def test_opening_a_small_file_prefetches_the_files_after_it_across_directories(spoke: SpokeMount, dataset: Path) -> None:
    """Sibling prefetch follows tree order: past the end of a directory into the next one."""
    first_dir, next_dir = sorted((dataset / "small" / "dir 0").iterdir()), sorted((dataset / "small" / "dir 1").iterdir())
    opened = first_dir[-2]
    assert (spoke.mountpoint / opened.relative_to(dataset)).read_bytes() == opened.read_bytes()
    wanted = [first_dir[-1], *next_dir[:8]]
    # Asked for (a batch under way or done): reading them waits for it, no miss.
    stats = wait_for_stats(spoke, lambda stats: stats["readahead_fetches"] >= len(wanted))
    for path in wanted:  # prefetched (cached or on its way): not a miss
        assert (spoke.mountpoint / path.relative_to(dataset)).read_bytes() == path.read_bytes()
    assert spoke.stats()["block_misses"] == stats["block_misses"]


def test_a_file_of_a_batch_reaches_its_reader_before_the_rest_of_the_batch(dataset: Path, tmp_path: Path) -> None:
    """Each small file of a batch is checked and handed to its readers as soon as its bytes have
    arrived: with every batch answer held for 3 s after its first file, that file reads at once."""
    files = sorted((dataset / "small" / "dir 3").iterdir())
    first_of_batch = files[1]  # opening files[0] asks for the files after it, in batches
    with running_hub(dataset) as hub:
        with running_fault_proxy(hub.url, fault_rate=0.0, stall_s=3.0,
                                 stall_batches_after=first_of_batch.stat().st_size) as proxy:
            with mounted_spoke(proxy.url, tmp_path, SPOKE_ARGS) as spoke:
                mounted = [spoke.mountpoint / path.relative_to(dataset) for path in files]
                assert mounted[0].read_bytes() == files[0].read_bytes()
                wait_for_stats(spoke, lambda _stats: proxy.counts["stalled batches"] >= 1)
                started = time.monotonic()
                assert mounted[1].read_bytes() == first_of_batch.read_bytes()
                waited_s = time.monotonic() - started
                for path, source in zip(mounted[2:], files[2:], strict=True):
                    assert path.read_bytes() == source.read_bytes()
                stats = spoke.stats()
    assert waited_s < 1.5, f"the first file of a held batch took {waited_s:.1f} s"
    assert stats["block_misses"] <= 1 and stats["fetch_failures"] == 0


def test_opening_a_cached_small_file_reads_the_files_after_it_into_memory(hub, dataset: Path, tmp_path: Path) -> None:
    """A walk through cached small files, their data files out of the page cache: opening one
    has the kernel read the files after it into memory in the background, so their reads do
    not each wait for the disk in turn."""
    files = sorted((dataset / "small").rglob("*.dat"))
    cache_dir = tmp_path / "cache"
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
        for path in files:
            assert (spoke.mountpoint / path.relative_to(dataset)).read_bytes() == path.read_bytes()
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= sum(path.stat().st_size for path in files))
    data_files = cache_data_files(cache_dir)
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
        assert evict_from_page_cache(data_files)
        assert (spoke.mountpoint / files[0].relative_to(dataset)).read_bytes() == files[0].read_bytes()

        def wholly_in_memory(path: Path) -> bool:
            # Under load the kernel may still be partway through a file (WILLNEED does not wait).
            return resident_pages(path) == -(-path.stat().st_size // mmap.PAGESIZE)

        deadline = time.monotonic() + 30
        while (in_memory := sum(1 for path in data_files if wholly_in_memory(path))) < len(files) - 1:
            assert time.monotonic() < deadline, f"{in_memory} of {len(files) - 1} files after it read into memory"
            time.sleep(0.05)
        for path in files[1:]:
            assert (spoke.mountpoint / path.relative_to(dataset)).read_bytes() == path.read_bytes()
        stats = spoke.stats()
    assert stats["fetches"] == 0
    assert stats["disk_reads"] <= 1, stats  # the opened file's own read; the rest came from memory


def test_files_fetched_ahead_reach_their_first_reader_from_memory(spoke: SpokeMount, dataset: Path) -> None:
    """Small files fetched ahead with a sibling are held in memory until read: with the
    cache's data files out of the page cache, reading them reads nothing back from disk."""
    files = sorted((dataset / "small" / "dir 2").iterdir())
    assert (spoke.mountpoint / files[0].relative_to(dataset)).read_bytes() == files[0].read_bytes()
    wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= sum(path.stat().st_size for path in files))
    evict_from_page_cache(cache_data_files(spoke.cache_dir))
    for path in files[1:]:
        assert (spoke.mountpoint / path.relative_to(dataset)).read_bytes() == path.read_bytes()
    stats = spoke.stats()
    assert stats["disk_reads"] == 0
    assert stats["block_misses"] <= 1


def test_a_stream_from_the_first_byte_starts_read_ahead_with_the_second_read(hub, dataset: Path, tmp_path: Path) -> None:
    """Two reads in a row from offset 0 start read-ahead (with a 16-block window); two in a row elsewhere do not yet."""

    def two_reads(path: Path, first_block: int) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)  # exactly these reads reach the daemon
        try:
            return b"".join(os.pread(fd, TEST_BLOCK_SIZE, (first_block + i) * TEST_BLOCK_SIZE) for i in range(2))
        finally:
            os.close(fd)

    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        elsewhere = "shards/shard-001.bin"
        source = (dataset / elsewhere).read_bytes()
        assert two_reads(spoke.mountpoint / elsewhere, 10) == source[10 * TEST_BLOCK_SIZE : 12 * TEST_BLOCK_SIZE]
        time.sleep(0.3)
        assert spoke.stats()["readahead_fetches"] == 0
        from_start = "shards/shard-000.bin"  # 49 blocks
        assert two_reads(spoke.mountpoint / from_start, 0) == (dataset / from_start).read_bytes()[: 2 * TEST_BLOCK_SIZE]
        wait_for_stats(spoke, lambda stats: stats["readahead_fetches"] >= 16)


def test_read_ahead_reaches_the_last_blocks_of_a_file(tmp_path: Path) -> None:
    """A stream's window asks in whole runs of blocks, but the file's last few (fewer than a
    run) are asked for too once the window reaches the end: a 37-block file read block by
    block misses only its first two reads (before the stream is known)."""
    root, sources = _write_shards(tmp_path / "data", 1, 37)
    with running_hub(root) as hub, mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        fd = os.open(spoke.mountpoint / "shards" / "part-0.bin", os.O_RDONLY | os.O_DIRECT)
        try:  # single-block reads, each reaching the daemon
            read = b"".join(os.pread(fd, TEST_BLOCK_SIZE, blockno * TEST_BLOCK_SIZE) for blockno in range(37))
        finally:
            os.close(fd)
        assert read == sources[0]
        assert spoke.stats()["block_misses"] == 2


def test_blocks_read_ahead_reach_their_first_reader_from_memory(tmp_path: Path) -> None:
    """A stream's read-ahead blocks are written to the cache with O_DIRECT (not into the page
    cache) and held in memory until read: once its first window is cached, reading it reads
    nothing back from disk."""
    root, sources = _write_shards(tmp_path / "data", 1, 24)
    with running_hub(root) as hub, mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        fd = os.open(spoke.mountpoint / "shards" / "part-0.bin", os.O_RDONLY | os.O_DIRECT)
        try:  # single-block reads, each reaching the daemon
            head = b"".join(os.pread(fd, TEST_BLOCK_SIZE, blockno * TEST_BLOCK_SIZE) for blockno in range(2))
            wait_for_stats(spoke, lambda stats: stats["cached_blocks"] >= 18)  # and the window's 16 after them
            window = b"".join(os.pread(fd, TEST_BLOCK_SIZE, blockno * TEST_BLOCK_SIZE) for blockno in range(2, 18))
        finally:
            os.close(fd)
        assert head + window == sources[0][: 18 * TEST_BLOCK_SIZE]
        stats = spoke.stats()
    assert stats["readahead_used"] == 16 and stats["block_misses"] == 2
    assert stats["disk_reads"] == 0, stats


def _write_shards(root: Path, count: int, blocks: int) -> tuple[Path, list[bytes]]:
    """`count` files of `blocks` test blocks of random bytes under root/shards; returns root and their bytes."""
    (root / "shards").mkdir(parents=True)
    sources = [random.Random(index).randbytes(blocks * TEST_BLOCK_SIZE) for index in range(count)]
    for index, data in enumerate(sources):
        (root / "shards" / f"part-{index}.bin").write_bytes(data)
    return root, sources


def _start_streams_and_close(mountpoint: Path, count: int) -> None:
    """Read blocks 0 and 1 of each of `count` shards at once (read-ahead then asks for the
    next 16 blocks of each) and close them."""

    def start(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:  # two single-block reads, each reaching the daemon
            os.pread(fd, TEST_BLOCK_SIZE, 0)
            os.pread(fd, TEST_BLOCK_SIZE, TEST_BLOCK_SIZE)
        finally:
            os.close(fd)

    starters = [threading.Thread(target=start, args=(mountpoint / "shards" / f"part-{index}.bin",))
                for index in range(count)]
    for starter in starters:
        starter.start()
    for starter in starters:
        starter.join(timeout=60)
    assert not any(starter.is_alive() for starter in starters), "reads hang"


def test_read_ahead_queued_for_a_closed_file_is_dropped(tmp_path: Path) -> None:
    """Eight streams want 32 read-ahead runs; READAHEAD_RUNS_IN_FLIGHT go out (the link holds
    them 4 s), the rest wait for a slot. The files are closed at once: the waiting runs are
    dropped, never sent."""
    root, sources = _write_shards(tmp_path / "data", 8, 48)
    with running_hub(root) as hub:
        with running_fault_proxy(hub.url, fault_rate=0.0, delay_s=4.0, delay_min_bytes=2 * TEST_BLOCK_SIZE) as proxy:
            with mounted_spoke(proxy.url, tmp_path, SPOKE_ARGS) as spoke:
                _start_streams_and_close(spoke.mountpoint, len(sources))
                wait_for_stats(spoke, lambda _stats: proxy.data_in_flight >= READAHEAD_RUNS_IN_FLIGHT)
                wait_for_stats(spoke, lambda _stats: proxy.data_in_flight == 0)
                time.sleep(0.5)  # a run that got a slot as the last ones finished would show by now
                assert proxy.data_in_flight == 0
                runs_sent = proxy.counts["delayed"]
                assert spoke.stats()["readahead_fetches"] == 4 * runs_sent  # runs of 4 blocks
    assert runs_sent == READAHEAD_RUNS_IN_FLIGHT


def test_read_ahead_of_many_readers_keeps_its_requests_in_flight_bounded(tmp_path: Path) -> None:
    """Eight streams over a slow link want ~32 read-ahead requests at once; the hub sees at most
    READAHEAD_RUNS_IN_FLIGHT of them plus the readers' own misses, and every byte is right."""
    blocks = 48
    root, sources = _write_shards(tmp_path / "data", 8, blocks)
    read: dict[int, bytes] = {}

    def stream(mountpoint: Path, index: int) -> None:
        fd = os.open(mountpoint / "shards" / f"part-{index}.bin", os.O_RDONLY | os.O_DIRECT)
        try:  # block by block: at most one demand miss of this reader at a time
            read[index] = b"".join(os.pread(fd, TEST_BLOCK_SIZE, block * TEST_BLOCK_SIZE) for block in range(blocks))
        finally:
            os.close(fd)

    with running_hub(root) as hub, running_fault_proxy(hub.url, fault_rate=0.0, delay_s=0.2) as proxy:
        with mounted_spoke(proxy.url, tmp_path, SPOKE_ARGS) as spoke:
            readers = [threading.Thread(target=stream, args=(spoke.mountpoint, index)) for index in range(8)]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join(timeout=120)
            assert not any(reader.is_alive() for reader in readers), "readers hang"
            assert spoke.stats()["readahead_fetches"] > 0
    assert read == dict(enumerate(sources))
    # Each stream's window (16 blocks, then more) is 4+ requests of 4 blocks: 32+ wanted at once.
    assert READAHEAD_RUNS_IN_FLIGHT <= proxy.most_data_in_flight <= READAHEAD_RUNS_IN_FLIGHT + len(readers)


def test_unmount_with_read_ahead_in_flight_is_prompt_and_leaves_a_consistent_cache(tmp_path: Path) -> None:
    """Eight streams start read-ahead and close their files; the link holds read-ahead's runs
    (multi-block ranges) for a minute. The unmount right after cancels them: it returns within
    seconds, not after the 30 s fetch timeout; the daemon exits without a traceback; a remount
    reads every byte identical."""
    root, sources = _write_shards(tmp_path / "data", 8, 48)
    cache_dir = tmp_path / "cache"

    with running_hub(root) as hub:
        with running_fault_proxy(hub.url, fault_rate=0.0, delay_s=60.0, delay_min_bytes=2 * TEST_BLOCK_SIZE) as proxy:
            spoke = mount_spoke(proxy.url, tmp_path / "mnt", cache_dir, [*SPOKE_ARGS, "--fetch-timeout", "30"])
            try:
                _start_streams_and_close(spoke.mountpoint, len(sources))
                wait_for_stats(spoke, lambda _stats: proxy.data_in_flight >= READAHEAD_RUNS_IN_FLIGHT)
                began = time.monotonic()
                result = run_cachefs("unmount", spoke.mountpoint)
                assert result.returncode == 0, result.stderr
                assert spoke.pid is not None and wait_for_pid(spoke.pid, 20.0)
                assert time.monotonic() - began < 10.0
            finally:
                spoke.unmount()
        log = spoke.log_text()
        assert "Traceback" not in log and "ERROR" not in log, log
        with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir, name="again") as again:
            for index, data in enumerate(sources):
                assert (again.mountpoint / "shards" / f"part-{index}.bin").read_bytes() == data
            assert again.stats()["corrupt_blocks"] == 0


# A reader in a subprocess, so that a test can kill it mid-read: `direct` reads block 0
# with O_DIRECT (a request the reader waits for), else the file whole through the page cache.
_READER = """
import os, sys
if sys.argv[2] == "direct":
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
    os.pread(fd, int(sys.argv[3]), 0)
else:
    open(sys.argv[1], "rb").read()
"""


def _start_readers(mountpoint: Path, count: int, mode: str) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", _READER, str(mountpoint / "shards" / f"part-{index}.bin"), mode,
                              str(TEST_BLOCK_SIZE)]) for index in range(count)]


def test_readers_killed_while_the_hub_holds_their_reads(tmp_path: Path) -> None:
    """Readers wait for a hub that answers after seconds. Killed in direct reads, their
    requests get a FUSE INTERRUPT: the daemon answers them when the hub does, answers
    other requests meanwhile, and then serves every byte. Killed in page-cache reads,
    they leave at once, and an unmount with their reads still in flight in the daemon
    ends it after the fetch timeout, long before the hub would answer, without a
    traceback."""
    root, sources = _write_shards(tmp_path / "data", 4, 4)
    with running_hub(root) as hub:
        with running_fault_proxy(hub.url, fault_rate=0.0, delay_s=6.0) as proxy:
            with mounted_spoke(proxy.url, tmp_path, [*SPOKE_ARGS, "--fetch-timeout", "30"]) as spoke:
                readers = _start_readers(spoke.mountpoint, len(sources), "direct")
                wait_for_stats(spoke, lambda _stats: proxy.data_in_flight >= len(readers))
                for reader in readers:
                    reader.kill()
                began = time.monotonic()
                assert spoke.stats()["pid"] == spoke.pid
                assert time.monotonic() - began < 3.0  # not after the held reads
                for reader in readers:
                    assert reader.wait(timeout=30) == -signal.SIGKILL
                with ThreadPoolExecutor(len(sources)) as pool:  # side by side: each fetch waits for the hub
                    read = pool.map(lambda index: (spoke.mountpoint / "shards" / f"part-{index}.bin").read_bytes(),
                                    range(len(sources)))
                    assert list(read) == sources
            assert "Traceback" not in spoke.log_text(), spoke.log_text()

        with running_fault_proxy(hub.url, fault_rate=0.0, delay_s=60.0) as proxy:
            spoke = mount_spoke(proxy.url, tmp_path / "held", tmp_path / "held-cache", SPOKE_ARGS)  # fetch timeout 5 s
            try:
                readers = _start_readers(spoke.mountpoint, len(sources), "cached")
                wait_for_stats(spoke, lambda _stats: proxy.data_in_flight >= len(readers))
                for reader in readers:
                    reader.kill()
                for reader in readers:
                    assert reader.wait(timeout=10) == -signal.SIGKILL
                began = time.monotonic()
                result = run_cachefs("unmount", spoke.mountpoint)
                assert result.returncode == 0, result.stderr
                assert spoke.pid is not None and wait_for_pid(spoke.pid, 30.0)
                assert time.monotonic() - began < 30.0  # not after the held reads
            finally:
                spoke.unmount()
            assert "Traceback" not in spoke.log_text(), spoke.log_text()


def test_read_ahead_follows_a_reader_that_takes_every_other_file(tmp_path: Path) -> None:
    """A reader that streams files 0, 2, 4 (a rank of a job sharing shards out round robin)
    gets the head of file 4 asked for near the end of file 2 (its last move), not file 3, and
    that of file 6 near the end of file 4, not file 5."""
    root, sources = _write_shards(tmp_path / "data", 8, 8)
    with running_hub(root) as hub:
        ids = {entry["p"]: entry["i"] for entry in fetch_manifest(hub).files().values()}
        with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
            for index in (0, 2, 4):
                fd = os.open(spoke.mountpoint / "shards" / f"part-{index}.bin", os.O_RDONLY | os.O_DIRECT)
                try:  # block by block: each read reaches the daemon
                    read = b"".join(os.pread(fd, TEST_BLOCK_SIZE, block * TEST_BLOCK_SIZE) for block in range(8))
                finally:
                    os.close(fd)
                assert read == sources[index]
            wait_for_stats(spoke, lambda stats: f"/v1/files/{ids['shards/part-6.bin']}?" in hub.stderr_text())
    asked = hub.stderr_text()
    assert f"/v1/files/{ids['shards/part-3.bin']}?" not in asked and f"/v1/files/{ids['shards/part-5.bin']}?" not in asked


def test_read_ahead_runs_on_into_the_next_file_of_a_reader_on_course(tmp_path: Path) -> None:
    """A reader that streamed file 0 and then file 1 to its end has its read-ahead
    window (grown to 64 blocks) run on into file 2: its first 64 blocks are cached
    and read with the hub gone. After file 0 alone (no move between files seen
    yet) only file 1's first run of 4 blocks is asked for."""
    blocks = 96
    root, sources = _write_shards(tmp_path / "data", 3, blocks)

    def stream(mountpoint: Path, index: int) -> bytes:
        fd = os.open(mountpoint / "shards" / f"part-{index}.bin", os.O_RDONLY | os.O_DIRECT)
        try:  # block by block: each read reaches the daemon, and the window grows
            return b"".join(os.pread(fd, TEST_BLOCK_SIZE, block * TEST_BLOCK_SIZE) for block in range(blocks))
        finally:
            os.close(fd)

    with running_hub(root) as hub, mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        assert stream(spoke.mountpoint, 0) == sources[0]
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= (blocks + 4) * TEST_BLOCK_SIZE)
        time.sleep(0.5)
        assert spoke.stats()["cached_bytes"] == (blocks + 4) * TEST_BLOCK_SIZE
        assert stream(spoke.mountpoint, 1) == sources[1]
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= (2 * blocks + 64) * TEST_BLOCK_SIZE)
        hub.stop()
        head = 64 * TEST_BLOCK_SIZE
        assert read_uncached(spoke.mountpoint / "shards" / "part-2.bin", 0, head) == sources[2][:head]


def test_sibling_prefetch_asks_for_at_most_16_mib(tmp_path: Path) -> None:
    """Opening one small file prefetches the files after it, but not more than 16 MiB of them."""
    root = tmp_path / "data"
    (root / "d").mkdir(parents=True)
    size = 1024 * 1024 - 1  # small: one block of 1 MiB
    for index in range(40):
        (root / "d" / f"f{index:02d}.bin").write_bytes(bytes([index]) * size)
    with running_hub(root) as hub, mounted_spoke(hub.url, tmp_path, ("--block-size", "1M")) as spoke:
        assert (spoke.mountpoint / "d" / "f00.bin").read_bytes() == bytes(size)
        stats = wait_for_stats(spoke, lambda stats: stats["readahead_fetches"] >= 16)
        time.sleep(0.5)
        assert spoke.stats()["readahead_fetches"] == stats["readahead_fetches"] == 16


def test_a_large_file_read_at_random_is_filled_in_the_background(hub, dataset: Path, tmp_path: Path) -> None:
    relative = "shards/shard-000.bin"  # 3 MiB + 17: 49 blocks of 64 KiB
    source = (dataset / relative).read_bytes()
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        for offset in (2_900_000, 500_000, 2_000_000, 1_200_000):  # FILL_AFTER_RANDOM_READS reads, far apart: random
            assert read_uncached(spoke.mountpoint / relative, offset, 4096) == source[offset : offset + 4096]
        stats = wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= len(source))
        assert stats["block_misses"] <= 4 and stats["readahead_fetches"] >= 45
        assert read_uncached(spoke.mountpoint / relative) == source
        assert spoke.stats()["block_misses"] == stats["block_misses"]
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--cache-size", "1M"), name="small-cache") as spoke:
        for offset in (2_900_000, 500_000, 2_000_000, 1_200_000, 3_000_000, 400_000):  # the file does not fit: no fill
            assert read_uncached(spoke.mountpoint / relative, offset, 4096) == source[offset : offset + 4096]
        time.sleep(0.5)
        assert spoke.stats()["readahead_fetches"] == 0


def test_index_of_an_older_version_is_dropped_not_misread(hub, dataset: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    relative = "shards/shard-001.bin"
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
        assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
        wait_for_stats(spoke, lambda stats: stats["cached_bytes"] > 0)
    env = lmdb.open(str(cache_dir / "index.lmdb"), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"index_format", b"1")
    env.close()
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
        assert spoke.stats()["cached_bytes"] == 0
        assert cache_data_files(cache_dir) == []
        assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
    assert "from an older cachefs: dropped its" in (cache_dir / "cachefs.log").read_text()


def test_sighup_is_no_reload_and_sigterm_unmounts(hub, tmp_path: Path) -> None:
    """SIGHUP (what reloads a hub's tokens) is logged and changes nothing; SIGTERM unmounts. And
    `cachefs stats | head -1` ends without a traceback."""
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        assert spoke.pid is not None
        os.kill(spoke.pid, signal.SIGHUP)
        assert wait_until(lambda: "received SIGHUP: nothing is reloaded" in spoke.log_text(), 10)
        assert is_mounted(spoke.mountpoint) and os.listdir(spoke.mountpoint)
        head = subprocess.run(f"{shlex.join(cachefs_command('stats', spoke.mountpoint))} | head -1", shell=True,
                              capture_output=True, text=True, env=hub_env(), timeout=60)
        assert head.stdout.count("\n") == 1 and "Traceback" not in head.stderr, head.stderr
        os.kill(spoke.pid, signal.SIGTERM)
        for _ in range(200):
            if not is_mounted(spoke.mountpoint):
                break
            threading.Event().wait(0.05)
        assert not is_mounted(spoke.mountpoint)
