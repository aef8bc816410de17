"""Training-aware caching: plans from cachefs.plan drive prefetch and eviction on a real mount."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import socket
import subprocess
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE
from hub_helpers import free_port, running_hub, sample, scrape_metrics
from mount_helpers import SpokeMount, mounted_spoke, read_uncached, run_cachefs, spoke_metrics, wait_for_stats

from bench.plan_bench import belady_hits
from cachefs import plan as cachefs_plan
from cachefs.cache import BlockKey
from cachefs.errors import CachefsError
from cachefs.namespace.tree import KIND_FILE, Inode
from cachefs.training import entries, planner, plans
from cachefs.training.planner import INITIAL_LOOKAHEAD_BLOCKS

# No read-ahead of the reader's own: every prefetch in these tests is the plan's.
PLAIN_ARGS = (*SPOKE_ARGS, "--readahead-blocks", "0", "--prefetch-siblings", "0")
WAIT_S = 20.0

Read = tuple[str, int, int | None]


def settled(spoke: SpokeMount) -> dict[str, Any]:
    """Stats once plan prefetch has stopped changing (nothing left it may fetch)."""
    previous = None
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        stats = spoke.stats()
        if previous is not None and stats["plan_prefetch_blocks"] == previous["plan_prefetch_blocks"]:
            return stats
        previous = stats
        time.sleep(0.3)
    raise AssertionError("plan prefetch did not settle")


def shard_blocks(dataset: Path) -> list[Read]:
    """Every block of every shard, as block-sized reads."""
    reads: list[Read] = []
    for shard in sorted((dataset / "shards").iterdir()):
        size = shard.stat().st_size
        reads.extend((f"shards/{shard.name}", offset, min(TEST_BLOCK_SIZE, size - offset))
                     for offset in range(0, size, TEST_BLOCK_SIZE))
    return reads


def expected(dataset: Path, read: Read) -> bytes:
    relative, offset, length = read
    with open(dataset / relative, "rb") as source:
        source.seek(offset)
        return source.read(length if length is not None else -1)


def read_through(spoke: SpokeMount, dataset: Path, reads: list[Read]) -> None:
    for read in reads:
        relative, offset, length = read
        assert read_uncached(spoke.mountpoint / relative, offset, length) == expected(dataset, read), read


def in_mount(spoke: SpokeMount, reads: list[Read]) -> list[Read]:
    return [(str(spoke.mountpoint / relative), offset, length) for relative, offset, length in reads]


def test_plan_prefetch_serves_identical_bytes(hub, dataset: Path, tmp_path: Path) -> None:
    reads = shard_blocks(dataset)
    random.Random(1).shuffle(reads)
    small = sorted(p.relative_to(dataset) for p in (dataset / "small").rglob("*") if p.is_file())[:20]
    reads += [(str(path), 0, None) for path in small]  # whole files, length None
    blocks = len(reads)
    with mounted_spoke(hub.url, tmp_path, PLAIN_ARGS) as spoke:
        with cachefs_plan.submit(in_mount(spoke, reads), epoch=1) as plan:
            assert (plan.epoch, plan.reads, plan.blocks) == (1, len(reads), blocks)
            read_through(spoke, dataset, reads)
            stats = wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)  # done: it ends by itself
        assert stats["plan_prefetch_blocks"] > 0
        assert stats["plan_prefetch_used_blocks"] > 0
        # Prefetch moved fetches earlier, it did not add any: each block crossed once.
        planned_bytes = sum(len(expected(dataset, read)) for read in reads)
        assert stats["fetched_bytes"] <= planned_bytes
        assert stats["block_hits"] + stats["block_misses"] >= blocks
        epoch = stats["training"]["epochs"][-1]
        assert epoch["epoch"] == 1 and epoch["fetched_bytes"] == stats["fetched_bytes"]
        # Read again, in another order: all from the cache now.
        random.Random(2).shuffle(reads)
        read_through(spoke, dataset, reads)
        assert spoke.stats()["fetched_bytes"] == stats["fetched_bytes"]


def test_a_plan_of_small_files_prefetches_them_in_batches(tmp_path: Path) -> None:
    """A sample per file (smaller than a block): plan prefetch spreads its window over the
    connections in batches of several files, not a request (a round trip) each, and serves
    each file's bytes once."""
    rng = random.Random(11)
    root = tmp_path / "root"
    for directory in range(3):
        (root / f"d{directory}").mkdir(parents=True)
        for index in range(60):
            (root / f"d{directory}" / f"{index:03d}.jpg").write_bytes(rng.randbytes(rng.randrange(1, TEST_BLOCK_SIZE)))
    files = sorted(path.relative_to(root) for path in root.rglob("*.jpg"))
    rng.shuffle(files)
    with running_hub(root) as hub, mounted_spoke(hub.url, tmp_path, (*PLAIN_ARGS, "--block-size", "1M")) as spoke:
        with cachefs_plan.submit([(spoke.mountpoint / path, 0, None) for path in files], epoch=1):
            read_through(spoke, root, [(str(path), 0, None) for path in files[:1]])  # the readers start
            prefetched = settled(spoke)["plan_prefetch_blocks"]
            metrics = scrape_metrics(hub)
            batches = sample(metrics, "cachefs_hub_requests_total", endpoint="batch", status="200")
            singles = sample(metrics, "cachefs_hub_requests_total", endpoint="files", status="206")
            # The first window (more uses than connections) in batches of two or more.
            assert prefetched >= INITIAL_LOOKAHEAD_BLOCKS // 2 and batches >= 1 and batches + singles <= prefetched // 2 + 1
            read_through(spoke, root, [(str(path), 0, None) for path in files])
            stats = wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
        assert stats["plan_prefetch_wasted_blocks"] == 0
        assert stats["fetched_bytes"] == sum((root / path).stat().st_size for path in files)  # each file once


def test_plan_that_lies_costs_only_bounded_counted_prefetch(hub, dataset: Path, tmp_path: Path) -> None:
    planned = [read for read in shard_blocks(dataset) if read[0] == "shards/shard-000.bin"]
    actual = [read for read in shard_blocks(dataset) if read[0] == "shards/shard-001.bin"]
    random.Random(3).shuffle(actual)
    with mounted_spoke(hub.url, tmp_path, PLAIN_ARGS) as spoke:
        with cachefs_plan.submit(in_mount(spoke, planned), epoch=1):
            read_through(spoke, dataset, actual)
            during = settled(spoke)
        stats = wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
        # The plan's first window was fetched, nothing beyond it; none of it was read.
        assert 0 < stats["plan_prefetch_blocks"] <= INITIAL_LOOKAHEAD_BLOCKS
        assert stats["plan_prefetch_blocks"] == during["plan_prefetch_blocks"]
        assert stats["plan_prefetch_wasted_blocks"] == stats["plan_prefetch_blocks"]
        assert stats["plan_prefetch_used_blocks"] == 0
        assert stats["plan_unplanned_blocks"] >= len(actual)
        assert stats["fetch_failures"] == 0
        read_through(spoke, dataset, planned + actual)  # still right, whatever the plan said


def test_plans_for_missing_files_are_rejected(spoke: SpokeMount, tmp_path: Path) -> None:
    mountpoint = spoke.mountpoint
    (tmp_path / "data").symlink_to(mountpoint / "shards")  # paths through a symlink into the mount are fine
    with cachefs_plan.submit([(tmp_path / "data/shard-000.bin", 0, 100)]) as plan:
        assert plan.blocks == 1
    with pytest.raises(cachefs_plan.PlanError, match="no such file in the mounted snapshot: shards/nope.bin"):
        cachefs_plan.submit([(mountpoint / "shards/shard-000.bin", 0, 100), (mountpoint / "shards/nope.bin", 0, 100)])
    with pytest.raises(cachefs_plan.PlanError, match="not a regular file: shards"):
        cachefs_plan.submit([(mountpoint / "shards", 0, 100)])
    with pytest.raises(cachefs_plan.PlanError, match="beyond the end"):
        cachefs_plan.submit([(mountpoint / "shards/shard-002.bin", 10 * TEST_BLOCK_SIZE, 100)])
    with pytest.raises(cachefs_plan.PlanError, match="not inside a cachefs mount"):
        cachefs_plan.submit([(tmp_path / "elsewhere.bin", 0, 100)])
    with cachefs_plan.submit([(mountpoint / "shards/shard-000.bin", 0, 100)]) as plan:
        assert plan.epoch == 2  # the rejected plans started no epoch (before: 5)
    stats = wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
    assert stats["plan_prefetch_blocks"] <= 1
    assert [record["epoch"] for record in stats["training"]["epochs"]] == [1, 2]
    assert (mountpoint / "with space.txt").read_text() == "a name with a space\n"


def test_a_plan_of_huge_lines_never_stops_the_daemon_serving_and_a_table_too_long_is_refused(spoke: SpokeMount) -> None:
    """A plan line costs the daemon work per block it names, whatever its bytes: a line of
    300,000 reads of a whole shard (a few MB) must not stop the daemon answering for
    seconds; and a file table longer than the snapshot's entries (one path repeated) is refused."""
    shard = spoke.mountpoint / "shards/shard-000.bin"
    blocks = -(-shard.stat().st_size // TEST_BLOCK_SIZE)

    def plan_connection() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(60)
        sock.connect(str(spoke.cache_dir / "control.sock"))
        return sock

    with plan_connection() as sock:
        sock.sendall(b'{"command": "plan"}\n{"files": ["shards/shard-000.bin"]}\n')
        sock.sendall(b'{"reads": [' + b",".join([b"[0,0,null]"] * 300_000) + b"]}\n")
        longest, deadline = 0.0, time.monotonic() + 3
        while time.monotonic() < deadline:
            started = time.monotonic()
            os.getxattr(spoke.mountpoint, "user.cachefs.stats")  # answered by the event loop
            longest = max(longest, time.monotonic() - started)
        assert blocks > 1 and longest < 0.5, longest  # the whole line is 300,000 x blocks uses: seconds of work
    with plan_connection() as sock:
        sock.sendall(b'{"command": "plan"}\n{"files": [' + b",".join([b'"shards/shard-000.bin"'] * 100_000) + b"]}\n")
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["ok"] is False and "file table is longer than the snapshot" in answer["error"], answer


def test_cancelling_a_plan_stops_its_prefetch(hub, dataset: Path, tmp_path: Path) -> None:
    reads = shard_blocks(dataset)  # 85 blocks: more than one lookahead window
    random.Random(4).shuffle(reads)
    with mounted_spoke(hub.url, tmp_path, PLAIN_ARGS) as spoke:
        plan = cachefs_plan.submit(in_mount(spoke, reads), epoch=1)
        read_through(spoke, dataset, reads[:4])
        window = settled(spoke)["plan_prefetch_blocks"]
        assert 0 < window < len(reads)
        plan.close()
        stats = wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
        read_through(spoke, dataset, reads[4:])  # as planned, but the plan is gone
        after = spoke.stats()
        assert after["plan_prefetch_blocks"] == stats["plan_prefetch_blocks"]  # nothing more was prefetched
        assert after["plan_unplanned_blocks"] == 0  # no plan active: reads are not matched against any
        accounted = after["plan_prefetch_used_blocks"] + after["plan_prefetch_wasted_blocks"]
        assert accounted == after["plan_prefetch_blocks"]  # every prefetched block counted once, used or wasted


class ShuffledBlocks:
    """A sampler: a new shuffled order of the block indices each epoch (set_epoch, like DistributedSampler)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.count

    def __iter__(self):  # type: ignore[no-untyped-def]
        order = list(range(self.count))
        random.Random(self.epoch).shuffle(order)
        return iter(order)


def test_plan_sampler_epochs_over_twice_the_cache_near_belady(hub, dataset: Path, tmp_path: Path) -> None:
    blocks = shard_blocks(dataset)
    capacity = len(blocks) // 2
    args = (*PLAIN_ARGS, "--cache-size", str(capacity * TEST_BLOCK_SIZE))
    with mounted_spoke(hub.url, tmp_path, args) as spoke:
        mounted = in_mount(spoke, blocks)
        sampler = cachefs_plan.PlanSampler(ShuffledBlocks(len(blocks)), lambda index: [mounted[index]], strict=True)
        trace, fetched = [], []
        for epoch in range(1, 4):
            sampler.set_epoch(epoch)
            before = spoke.stats()
            order = list(sampler)  # the plan is handed over here, before the first index
            assert sorted(order) == list(range(len(blocks)))
            assert sampler.plan is not None and sampler.plan.epoch == epoch
            read_through(spoke, dataset, [blocks[index] for index in order])
            after = spoke.stats()
            trace.append([f"{blocks[i][0]}:{blocks[i][1]}" for i in order])
            fetched.append(after["fetched_bytes"] - before["fetched_bytes"])
        sampler.close()
        optimum = belady_hits(trace, capacity)
        total_bytes = sum(length for _path, _offset, length in blocks if length)
        for epoch in (1, 2):  # epochs 2 and 3
            # Each block is read once per epoch: the bytes not fetched are the hits.
            hit_ratio = 1 - fetched[epoch] / total_bytes
            assert hit_ratio >= 0.9 * optimum[epoch] / len(blocks), (epoch + 1, hit_ratio, optimum, fetched)
        records = spoke.stats()["training"]["epochs"]
        assert [record["epoch"] for record in records] == [1, 2, 3]
        assert records[0]["fetched_bytes"] == fetched[0]


def test_stats_and_metrics_show_epochs_stalls_and_time_to_warm(hub, dataset: Path, tmp_path: Path) -> None:
    reads = shard_blocks(dataset)
    port = free_port()
    with mounted_spoke(hub.url, tmp_path, (*PLAIN_ARGS, "--metrics-listen", f"127.0.0.1:{port}")) as spoke:
        for epoch in (1, 2):
            with cachefs_plan.submit(in_mount(spoke, reads), epoch=epoch):
                read_through(spoke, dataset, reads)
        stats = spoke.stats()
        metrics = spoke_metrics(port)
        first, second = stats["training"]["epochs"]
        assert first["fetched_bytes"] > 0 and second["fetched_bytes"] == 0
        assert second["hit_ratio"] == 1.0 and second["stall_seconds"] == 0
        assert second["time_to_warm_s"] == 0.0 and stats["training"]["warm"]
        assert first["stall_seconds"] <= stats["stall_seconds"]
        assert metrics["cachefs_epoch"] == 2 and metrics["cachefs_epoch_hit_ratio"] == 1.0
        assert metrics["cachefs_epoch_fetched_bytes"] == 0 and metrics["cachefs_time_to_warm_seconds"] >= 0
        assert metrics["cachefs_plan_prefetch_blocks_total"] == stats["plan_prefetch_blocks"] > 0
        assert metrics["cachefs_read_stall_seconds_count"] == stats["stalled_blocks"]
        assert metrics["cachefs_stall_seconds_total"] == pytest.approx(stats["stall_seconds"])
        shown = run_cachefs("stats", spoke.mountpoint)
        assert shown.returncode == 0, shown.stderr
        assert "time to warm" in shown.stdout and "reader stalls" in shown.stdout
        header, first_row, second_row = shown.stdout.splitlines()[-3:]
        assert header.split()[:3] == ["epoch", "time", "hit"]
        assert first_row.split()[0] == "1" and second_row.split()[0] == "2"
        assert "100.0 %" in second_row and second_row.endswith("(current)")


def test_plan_sampler_hands_over_in_the_background(hub, dataset: Path, tmp_path: Path) -> None:
    blocks = shard_blocks(dataset)
    with mounted_spoke(hub.url, tmp_path, PLAIN_ARGS) as spoke:
        mounted = in_mount(spoke, blocks)
        sampler = cachefs_plan.PlanSampler(ShuffledBlocks(len(blocks)), lambda index: [mounted[index]])
        for epoch in (1, 2):
            order = list(sampler)  # epochs count from 1 without set_epoch
            plan = sampler.wait(WAIT_S)
            assert plan is not None and plan.epoch == epoch and plan.blocks == len(blocks)
            read_through(spoke, dataset, [blocks[index] for index in order])
        previous = plan
        sampler.close()
        assert previous.closed
        stats = wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
        assert [record["epoch"] for record in stats["training"]["epochs"]] == [1, 2]
        assert stats["training"]["epochs"][1]["fetched_bytes"] == 0


def test_plan_sampler_outside_a_mount_samples_unplanned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "data.bin").write_bytes(b"x" * 100)
    sampler = cachefs_plan.PlanSampler(list(range(10)), lambda index: [(tmp_path / "data.bin", index * 10, 10)])
    with caplog.at_level(logging.WARNING):
        assert list(sampler) == list(range(10))
        assert sampler.wait(10) is None
        assert list(sampler) == list(range(10))
        assert sampler.wait(10) is None
    assert sum("training without a plan" in record.message for record in caplog.records) == 1
    with pytest.raises(cachefs_plan.PlanError, match="not inside a cachefs mount"):
        list(cachefs_plan.PlanSampler([0], lambda index: [(tmp_path / "data.bin", 0, 10)], strict=True))


def test_a_plan_sampler_whose_reads_of_fails_warns_once_and_strict_raises_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the caller's reads_of is one warning per sampler, not a thread's traceback each epoch."""
    uncaught: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: uncaught.append(hook.exc_value))

    def reads_of(index: int) -> list[Read]:
        raise KeyError(index)

    sampler = cachefs_plan.PlanSampler(list(range(4)), reads_of)
    with caplog.at_level(logging.WARNING):
        for _epoch in range(2):
            assert list(sampler) == list(range(4))
            assert sampler.wait(10) is None
    assert uncaught == []
    warnings = [record.message for record in caplog.records if "training without a plan" in record.message]
    assert warnings == ["cachefs: training without a plan: KeyError: 0"]
    with pytest.raises(KeyError):
        list(cachefs_plan.PlanSampler([0], reads_of, strict=True))


def windows(dataset: Path, size: int) -> list[Read]:
    """Every `size`-byte window of the two large shards (the last one of each shorter)."""
    reads: list[Read] = []
    for name in ("shard-000.bin", "shard-001.bin"):
        length = (dataset / "shards" / name).stat().st_size
        reads.extend((f"shards/{name}", offset, min(size, length - offset)) for offset in range(0, length, size))
    return reads


def test_a_plan_of_samples_much_smaller_than_the_blocks_is_advised_a_block_size_once(
        hub, dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """256 KiB blocks, 64 KiB samples read at random: each use reads a quarter of its block, and the
    plan advises --block-size 64K (a PlanSampler says so once, however many epochs); block-sized
    reads get no advice. The samples read through the mount are the source's bytes."""
    samples = windows(dataset, 64 * 1024)
    args = ("--block-size", "256K", "--fetch-timeout", "5", "--readahead-blocks", "0", "--prefetch-siblings", "0")
    with mounted_spoke(hub.url, tmp_path, args) as spoke:
        mounted = in_mount(spoke, samples)
        sampler = cachefs_plan.PlanSampler(ShuffledBlocks(len(samples)), lambda index: [mounted[index]])
        with caplog.at_level(logging.WARNING, logger="cachefs.plan"):
            for epoch in (1, 2):
                sampler.set_epoch(epoch)
                order = list(sampler)
                plan = sampler.wait(WAIT_S)
                assert plan is not None and plan.epoch == epoch
                assert plan.info["read_bytes"] == sum(length for _path, _offset, length in samples if length)
                assert plan.info["block_size"] == 256 * 1024
                assert plan.info["advised_block_size"] == 64 * 1024
                assert plan.advice is not None and plan.advice.endswith("mount with --block-size 64K")
                assert "(63 KiB on average) use 26 % of the 256K blocks" in plan.advice  # shorter last windows
                read_through(spoke, dataset, [samples[index] for index in order])
        sampler.close()
        advice = [record.getMessage() for record in caplog.records if "--block-size" in record.getMessage()]
        assert advice == [plan.advice]
        with cachefs_plan.submit(in_mount(spoke, windows(dataset, 256 * 1024))) as fitting:
            assert fitting.info["advised_block_size"] is None and fitting.advice is None


def test_entry_store_spills_beyond_memory_and_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entries, "CHUNK_ENTRIES", 4)
    monkeypatch.setattr(entries, "MEMORY_CHUNKS", 2)
    spill = tmp_path / "plans" / "1.entries"
    store = entries.EntryStore(spill)
    rng = random.Random(5)
    values = [rng.randrange(1 << 60) for _ in range(50)]
    for value in values:
        store.append(value)
    assert store.length == 50 and store.spilled_chunks == 10 and spill.exists()
    assert list(store.entries(0, 50)) == values
    assert list(store.entries(13, 31)) == values[13:31]
    store.drop_before(40)
    assert list(store.entries(40, 50)) == values[40:]
    store.close()
    assert not spill.exists()


def test_a_plan_of_many_files_keeps_a_compact_file_table(tmp_path: Path) -> None:
    """An ImageNet-like plan names a million files: its table costs a few dozen bytes a file
    (an Inode and a dict entry each took ~490), and lookups find each file by id and version."""
    count = 50_000
    inodes = [Inode(ino=2 + n, kind=KIND_FILE, mode=0o444, mtime_ns=0, size=40_000 + n, parent=1,
                    file_id=random.Random(n).randbytes(8), version=n.to_bytes(8, "big")) for n in range(count)]
    tracemalloc.start()
    try:
        plan = plans.Plan(1, entries.EntryStore(tmp_path / "1.entries"), block_size=1 << 20)
        before = tracemalloc.get_traced_memory()[0]
        for inode in inodes:
            plan.add_file(inode)
        plan.add_file(inodes[7])  # named twice: found at its first index
        plan.mark_complete()
        per_file = (tracemalloc.get_traced_memory()[0] - before) / count
    finally:
        tracemalloc.stop()
    assert per_file < 64, per_file
    for n in (0, 7, 12_345, count - 1):
        entry = plan.key_of(BlockKey(inodes[n].file_id, inodes[n].version, 3))
        assert entry is not None and plan.block_key(entry) == BlockKey(inodes[n].file_id, inodes[n].version, 3)
        assert plan.block_length(entry - 3) == 40_000 + n and plan.covers(inodes[n])
    assert plan.key_of(BlockKey(inodes[5].file_id, inodes[6].version, 0)) is None  # another version
    assert not plan.covers(dataclasses.replace(inodes[5], file_id=b"\0" * 8))
    plan.store.close()


def test_a_plan_that_cannot_be_spilled_is_refused_and_a_cut_spill_file_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nearly full disk writes part of a chunk and then fails: the plan is refused (before,
    the short write went unnoticed and reading the chunk back looped forever on the trio
    thread, hanging the mount); a spill file cut short later is an error, not a hang."""
    monkeypatch.setattr(entries, "CHUNK_ENTRIES", 4096)  # 32 KiB per chunk
    monkeypatch.setattr(entries, "MEMORY_CHUNKS", 1)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        with open(disk / "filler", "wb") as filler, contextlib.suppress(OSError):
            filler.write(bytes(256 * 1024 - 20 * 1024))  # 20 KiB left
        store = entries.EntryStore(disk / "plans" / "1.entries")
        with pytest.raises(CachefsError, match="cannot spill"):
            for value in range(3 * 4096):
                store.append(value)
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    store = entries.EntryStore(tmp_path / "2.entries")
    for value in range(3 * 4096):
        store.append(value)
    os.truncate(tmp_path / "2.entries", 4096 * 8 + 100)  # the second chunk cut short
    with pytest.raises(CachefsError, match="cut short"):
        list(store.entries(4096, 3 * 4096))
    store.close()


def test_a_block_read_often_but_not_planned_never_displaces_a_planned_one(hub, dataset: Path, tmp_path: Path) -> None:
    planned = [read for read in shard_blocks(dataset) if read[0] == "shards/shard-000.bin"][:4]
    unplanned = ("shards/shard-003.bin", 0, TEST_BLOCK_SIZE - 1)  # the whole file: one block
    args = (*PLAIN_ARGS, "--cache-size", str(len(planned) * TEST_BLOCK_SIZE))
    with mounted_spoke(hub.url, tmp_path, args) as spoke:
        read_through(spoke, dataset, planned)
        wait_for_stats(spoke, lambda s: s["cached_blocks"] == len(planned))
        with cachefs_plan.submit(in_mount(spoke, planned), epoch=1):
            for count in range(1, 5):  # more often than any planned block: TinyLFU alone would admit it
                read_through(spoke, dataset, [unplanned])
                decided = wait_for_stats(spoke, lambda s, count=count: s["rejected_blocks"] == count or s["evicted_blocks"])
                assert decided["evicted_blocks"] == 0, "a block no plan reads displaced one the plan reads next"
                # Out of the daemon's memory too, so the next read fetches and offers it again.
                assert run_cachefs("evict", spoke.mountpoint / unplanned[0]).returncode == 0
            before = spoke.stats()
            read_through(spoke, dataset, planned)
            after = spoke.stats()
        assert after["fetched_bytes"] == before["fetched_bytes"]  # every planned block was still cached
        assert after["evicted_blocks"] == 0


def test_a_read_just_before_a_plan_began_still_counts_as_its_first_use(hub, dataset: Path, tmp_path: Path) -> None:
    blocks = [read for read in shard_blocks(dataset) if read[0] == "shards/shard-000.bin"][:4]
    with mounted_spoke(hub.url, tmp_path, PLAIN_ARGS) as spoke:
        with cachefs_plan.submit(in_mount(spoke, blocks[:2]), epoch=1):
            read_through(spoke, dataset, blocks[:2])
        wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
        # The next epoch begins with the block the last one ended with.
        with cachefs_plan.submit(in_mount(spoke, blocks[1:]), epoch=2):
            read_through(spoke, dataset, blocks[1:2])
            [plan] = spoke.stats()["training"]["plans"]
            assert (plan["epoch"], plan["position"], plan["head"]) == (2, 1, 1)
            unplanned = spoke.stats()["plan_unplanned_blocks"]
            read_through(spoke, dataset, blocks[2:])
            assert spoke.stats()["plan_unplanned_blocks"] == unplanned


def _plan_of(tmp_path: Path, blocks: list[int]) -> plans.Plan:
    """A complete plan reading `blocks` (one use each, in this order) of one file, one byte per block."""
    plan = plans.Plan(1, entries.EntryStore(tmp_path / "1.entries"), block_size=1)
    plan.add_file(Inode(ino=2, kind=KIND_FILE, mode=0o444, mtime_ns=0, size=1 << 20, parent=1,
                        file_id=b"f" * 8, version=b"v" * 8))
    for block in blocks:
        plan.add_read(0, block, 1)
    plan.mark_complete()
    plan.extend_horizon(len(blocks))
    return plan


def test_a_held_block_its_plan_moved_past_is_judged_by_its_next_use(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entries, "CHUNK_ENTRIES", 8)  # the window drops consumed uses early
    blocks = [index % 50 for index in range(200)]  # block b is used at b, b + 50, b + 100, b + 150
    plan = _plan_of(tmp_path, blocks)
    key = plan.block_key(3)
    assert plan.distance_after(3, key) == 53  # held for its use at 3: the use at 53 is what counts
    for position, block in enumerate(blocks[:110]):
        if position != 3:  # the held copy's reader never came (its use was served elsewhere)
            plan.observe(block, reach=1000)
    plan.trail = 4
    plan.advance_tail()
    assert plan.tail > 3 and plan.next_use_after(3) is None  # behind the window: forgotten, not misread
    # The copy covers no use any more: the block counts by its next unconsumed use (153), not as never used.
    assert plan.distance_after(3, key) == plan.distance(key) == 153 - plan.tail


def test_the_trail_grows_to_cover_dataloader_workers_far_apart(tmp_path: Path) -> None:
    workers, batch, uses = 8, 64, 4096  # 512 uses in progress at once, more than the first trail
    plan = _plan_of(tmp_path, list(range(uses)))  # each sample its own block
    # Worker w reads batches w, w + workers, ...; the workers take turns sample by sample.
    order = sorted((round_ * batch * workers + index * workers + worker, (round_ * workers + worker) * batch + index)
                   for worker in range(workers) for round_ in range(uses // (batch * workers)) for index in range(batch))
    skipped_when_grown = None
    for _time, position in order:
        assert plan.observe(position, reach=1000)  # matched, or recognised as late: never unplanned
        if plan.late_reads and skipped_when_grown is None:
            skipped_when_grown = plan.skipped_uses  # the first slow reader came too late: the trail grew
    assert plan.trail > plans.MIN_TRAIL_ENTRIES and skipped_when_grown is not None
    assert plan.skipped_uses == skipped_when_grown < batch * workers // 2  # then no use was passed unread
    assert plan.late_reads == plan.skipped_uses  # and each one passed was read, late
    assert plan.finished.is_set()


def test_a_plan_nobody_reads_gives_its_held_blocks_up_to_one_that_is_read(hub, dataset: Path, tmp_path: Path) -> None:
    blocks = shard_blocks(dataset)
    idle = [read for read in blocks if read[0] == "shards/shard-000.bin"]  # 49 blocks: more than a window
    followed = [read for read in blocks if read[0] == "shards/shard-001.bin"]
    with mounted_spoke(hub.url, tmp_path, PLAIN_ARGS) as spoke:
        with cachefs_plan.submit(in_mount(spoke, idle), epoch=1):
            held = settled(spoke)["plan_prefetch_blocks"]
            assert held == INITIAL_LOOKAHEAD_BLOCKS  # its first window, held for readers that never come
            with cachefs_plan.submit(in_mount(spoke, followed), epoch=2):
                read_through(spoke, dataset, followed[:1])
                # Once the first plan has been idle for IDLE_PLAN_S, its blocks go and the second prefetches.
                stats = wait_for_stats(spoke, lambda s: s["plan_prefetch_blocks"] > held,
                                       timeout_s=planner.IDLE_PLAN_S + WAIT_S)
                first, second = stats["training"]["plans"]
                assert first["prefetch_wasted_blocks"] == held and first["prefetch_used_blocks"] == 0
                assert second["prefetched_blocks"] > 0
                read_through(spoke, dataset, followed[1:])


def test_a_plan_finds_readers_that_skipped_a_stretch_it_never_saw(tmp_path: Path) -> None:
    plan = _plan_of(tmp_path, list(range(5000)))
    reach = 288  # the initial lookahead (32) + MATCH_SLACK_ENTRIES
    matched = [plan.observe(position, reach) for position in range(400, 5000)]  # 0-399: the page cache served them
    assert matched[: plans.RESYNC_READS - 1] == [False] * (plans.RESYNC_READS - 1)
    assert all(matched[plans.RESYNC_READS - 1 :])  # found after RESYNC_READS reads, followed to the end
    assert plan.resyncs == 1 and plan.issued >= 400 and plan.finished.is_set()


def test_scattered_reads_of_planned_blocks_do_not_move_a_plan(tmp_path: Path) -> None:
    plan = _plan_of(tmp_path, list(range(5000)))
    rng = random.Random(6)
    for position in range(1000):  # its own readers, in order, and another job's reads of the same blocks
        assert plan.observe(position, reach=288)
        plan.observe(rng.randrange(2000, 5000), reach=288)
    for _ in range(1000):  # only the other job's
        plan.observe(rng.randrange(2000, 5000), reach=288)
    assert plan.resyncs == 0 and plan.head == 1000


def test_entry_store_gives_back_the_disk_space_of_what_it_forgot(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(entries, "CHUNK_ENTRIES", 4096)  # 32 KiB chunks: whole file system blocks
    monkeypatch.setattr(entries, "MEMORY_CHUNKS", 1)
    spill = tmp_path / "plans" / "1.entries"
    store = entries.EntryStore(spill)
    values = list(range(20 * 4096))
    for value in values:
        store.append(value)
    chunk_bytes = 4096 * 8
    allocated = spill.stat().st_blocks * 512
    assert store.spilled_chunks == 19 and allocated >= 18 * chunk_bytes
    store.drop_before(16 * 4096)  # chunks 0-15 forgotten; 1-15 were on disk
    assert spill.stat().st_blocks * 512 <= allocated - 15 * chunk_bytes
    assert list(store.entries(16 * 4096, len(values))) == values[16 * 4096 :]  # what is ahead reads back
    store.close()
    assert not spill.exists()


def test_a_plan_may_name_a_file_through_a_symlink_in_the_snapshot(spoke: SpokeMount, dataset: Path) -> None:
    """Datasets laid out as links to blobs (Hugging Face caches): a plan naming a link plans the
    file it leads to, whose reads through the link it then follows to its end. A link to a
    directory is no regular file."""
    link = spoke.mountpoint / "link-to-shard"
    with cachefs_plan.submit([(link, 0, 100)]) as plan:
        assert plan.blocks == 1
        with open(link, "rb") as through_the_link:
            assert through_the_link.read(100) == (dataset / "shards/shard-000.bin").read_bytes()[:100]
        wait_for_stats(spoke, lambda stats: stats["training"]["plans_active"] == 0)  # all its reads were seen
    with pytest.raises(cachefs_plan.PlanError, match="not a regular file: link-to-dir"):
        cachefs_plan.submit([(spoke.mountpoint / "link-to-dir", 0, 100)])


def test_a_malformed_read_or_epoch_is_a_plan_error_not_a_traceback(spoke: SpokeMount) -> None:
    """The client API says what is wrong with a read in one PlanError, not a TypeError or
    ValueError from deep inside it, nor a misleading 'not inside a cachefs mount'."""
    shard = spoke.mountpoint / "shards/shard-000.bin"
    bad = [
        ([str(shard)], "alone: give an iterable of reads"),  # a path where a read belongs
        ([str(shard)[:3]], "alone: give an iterable of reads"),  # one that would unpack into three
        ([(spoke.mountpoint, 0, 100)], "not a regular file"),  # the mount's root, not outside the mount
        ([(shard, 0)], "a read is (path, offset, length)"),
        ([(None, 0, 100)], "a read's path is a str or an os.PathLike"),
        ([(shard, "ten", 100)], "a read's offset and length are whole numbers"),
        ([(shard, float("nan"), 100)], "a read's offset and length are whole numbers"),
        ([(shard, 0, 100), (shard, 0, "all")], "a read's offset and length are whole numbers"),
    ]
    for reads, message in bad:
        with pytest.raises(cachefs_plan.PlanError, match=re.escape(message)):
            cachefs_plan.submit(reads)
    with cachefs_plan.submit([(os.fsencode(shard), 0, 100), (shard, 100.0, None)]) as plan:  # bytes paths, whole floats
        assert plan.reads == 2
    with pytest.raises(cachefs_plan.PlanError, match="epoch must be an integer from 0 to"):
        cachefs_plan.submit([(shard, 0, 100)], epoch=2**70)


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_plan_using_blocks_again_close_together_ends_when_read_in_its_order(tmp_path: Path, pieces: int) -> None:
    rng = random.Random(8)
    uses = [rng.randrange(64) for _ in range(2000)]  # many blocks used again within a few uses
    plan = _plan_of(tmp_path, [0, 1, 0, 1, *uses])
    for block in [0, 1, 0, 1, *uses]:
        for _piece in range(pieces):  # one sample's read may reach the daemon in several FUSE reads
            plan.hear(plan.block_key(block), reach=288)
    assert plan.skipped_uses == 0 and plan.finished.is_set()
    assert plan.matched_blocks == plan.store.length  # each use once: no piece was taken for a later use
