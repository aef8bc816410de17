"""torch's own DataLoader, with worker processes, through a real mount: every sample's bytes, plans, epochs, ranks."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SPOKE_ARGS
from hub_helpers import REPO_ROOT, HubProcess, hub_env, running_hub
from mount_helpers import SpokeMount, mounted_spoke, wait_for_stats
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from bench import torch_loader as torch_bench
from cachefs import plan as cachefs_plan

KiB = 1024
# Not a divisor of the 64 KiB test block: most samples span two blocks.
WINDOW = 40_000
SHARD_SIZES = (1024 * KiB, 1536 * KiB + 17, 700 * KiB + 3, 1024 * KiB)
BATCH = 8
WORKERS = 2
SEED = 11
WAIT_S = 20.0


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torch-source")
    rng = random.Random(SEED)
    (root / "shards").mkdir()
    for number, size in enumerate(SHARD_SIZES):
        (root / "shards" / f"shard-{number:02d}.bin").write_bytes(rng.randbytes(size))
    return root


@pytest.fixture(scope="module")
def torch_hub(shards: Path) -> Iterator[HubProcess]:
    with running_hub(shards) as hub:
        yield hub


@pytest.fixture
def mount(torch_hub: HubProcess, tmp_path: Path) -> Iterator[SpokeMount]:
    """A fresh mount, empty cache: every sample read in a test is a cold read unless a plan fetched it first."""
    with mounted_spoke(torch_hub.url, tmp_path, SPOKE_ARGS) as spoke:
        yield spoke


class Windows(Dataset):
    """Sample i: (i, the bytes of a WINDOW-byte window of a shard), read with os.pread in the worker process."""

    def __init__(self, directory: Path) -> None:
        self.paths = sorted(str(path) for path in directory.iterdir())
        self.samples = [(number, offset) for number, path in enumerate(self.paths)
                        for offset in range(0, os.path.getsize(path) - WINDOW + 1, WINDOW)]
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def reads_of(self, index: int) -> list[tuple[str, int, int]]:
        number, offset = self.samples[index]
        return [(self.paths[number], offset, WINDOW)]

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        number, offset = self.samples[index]
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = os.open(self.paths[number], os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return index, os.pread(fd, WINDOW, offset)


class Resumed(Sampler):
    """An inner sampler's order from position `start` on: how a training loop resumes an epoch part-way."""

    def __init__(self, inner: Any, start: int) -> None:
        self.inner, self.start = inner, start

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner) - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.inner)[self.start:])


def expected_bytes(shards: Path, dataset: Windows) -> list[bytes]:
    sources = [(shards / "shards" / os.path.basename(path)).read_bytes() for path in dataset.paths]
    return [sources[number][offset:offset + WINDOW] for number, offset in dataset.samples]


def loader_of(dataset: Windows, sampler: Any, persistent: bool) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS, persistent_workers=persistent)


def epoch_order(loader: DataLoader, expected: list[bytes]) -> list[int]:
    """One pass of the loader: the sample indices in the order delivered, each sample's bytes checked."""
    order: list[int] = []
    for indices, data in loader:
        for index, sample in zip(indices.tolist(), data, strict=True):
            assert sample == expected[index], f"sample {index}: wrong bytes"
            order.append(index)
    return order


@pytest.mark.parametrize("planned", [False, True], ids=["no-plan", "plan-sampler"])
def test_dataloader_workers_read_every_sample_and_set_epoch_reshuffles(planned: bool, mount: SpokeMount,
                                                                        shards: Path) -> None:
    dataset = Windows(mount.mountpoint / "shards")
    expected = expected_bytes(shards, dataset)
    inner = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    sampler = cachefs_plan.PlanSampler(inner, reads_of=dataset.reads_of) if planned else inner
    loader = loader_of(dataset, sampler, persistent=True)
    orders = {}
    for epoch in (1, 2, 1):
        sampler.set_epoch(epoch)
        order = epoch_order(loader, expected)
        assert sorted(order) == list(range(len(dataset)))
        assert orders.setdefault(epoch, order) == order  # the same epoch, the same order
        if planned:
            plan = sampler.wait(WAIT_S)
            assert plan is not None and plan.epoch == epoch and plan.reads == len(dataset)
    assert orders[1] != orders[2]
    del loader  # its persistent workers hold files in the mount open
    gc.collect()
    if planned:
        sampler.close()
        stats = wait_for_stats(mount, lambda s: s["training"]["plans_active"] == 0)
        assert [record["epoch"] for record in stats["training"]["epochs"]] == [1, 2, 1]
        assert stats["plan_prefetch_blocks"] > 0


def test_two_distributed_ranks_cover_the_dataset_once_through_plan_samplers(mount: SpokeMount, shards: Path) -> None:
    dataset = Windows(mount.mountpoint / "shards")
    assert len(dataset) % 2 == 0  # DistributedSampler pads an odd dataset with repeats
    expected = expected_bytes(shards, dataset)
    samplers = [cachefs_plan.PlanSampler(DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=SEED),
                                         reads_of=dataset.reads_of) for rank in (0, 1)]
    loaders = [loader_of(dataset, sampler, persistent=True) for sampler in samplers]
    for epoch in (1, 2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        ranks = [epoch_order(loader, expected) for loader in loaders]
        assert len(ranks[0]) == len(ranks[1]) == len(dataset) // 2
        assert sorted(ranks[0] + ranks[1]) == list(range(len(dataset)))
        for sampler in samplers:
            plan = sampler.wait(WAIT_S)
            assert plan is not None and plan.epoch == epoch and plan.reads == len(dataset) // 2
    del loaders  # their persistent workers hold files in the mount open
    gc.collect()
    for sampler in samplers:
        sampler.close()


def test_a_resumed_epoch_yields_exactly_the_remaining_samples(mount: SpokeMount, shards: Path) -> None:
    dataset = Windows(mount.mountpoint / "shards")
    expected = expected_bytes(shards, dataset)
    done_batches = 3
    full = cachefs_plan.PlanSampler(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED),
                                    reads_of=dataset.reads_of)
    full.set_epoch(4)
    order = list(full)
    full.close()
    # PlanSampler has no resume state of its own: the inner sampler skips what the run before consumed,
    # so the plan covers only what the resumed epoch reads.
    resumed = cachefs_plan.PlanSampler(
        Resumed(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED), done_batches * BATCH),
        reads_of=dataset.reads_of)
    resumed.set_epoch(4)
    loader = loader_of(dataset, resumed, persistent=False)
    assert epoch_order(loader, expected) == order[done_batches * BATCH:]
    plan = resumed.wait(WAIT_S)
    assert plan is not None and plan.epoch == 4 and plan.reads == len(dataset) - done_batches * BATCH
    resumed.close()


EPOCH_LINE = re.compile(r"^epoch 1: (\d+) samples in [\d.]+ s, [\d.]+ samples/s, busy ([\d.]+) %, loss [\d.]+$")


def test_the_pytorch_example_trains_an_epoch_through_a_mount_with_a_plan(mount: SpokeMount) -> None:
    window = 64 * KiB
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "train_pytorch.py"), "--data", str(mount.mountpoint / "shards"),
         "--epochs", "1", "--workers", "2", "--batch-size", "8", "--sample-size", "64K", "--compute-ms", "5"],
        capture_output=True, text=True, timeout=120, env=hub_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "without a plan" not in result.stderr
    samples = sum(size // window for size in SHARD_SIZES)
    lines = result.stdout.splitlines()
    assert lines[0] == f"{samples} samples of {window} bytes in {len(SHARD_SIZES)} files, batch 8, 2 workers"
    match = EPOCH_LINE.match(lines[1])
    assert match is not None, lines
    assert int(match.group(1)) == samples and 0 < float(match.group(2)) <= 100
    stats = wait_for_stats(mount, lambda s: s["training"]["plans_active"] == 0)
    assert [record["epoch"] for record in stats["training"]["epochs"]] == [1]
    assert stats["read_bytes"] >= samples * window


def test_link_bound_of_random_samples_smaller_than_a_block_is_far_above_the_compute_time() -> None:
    config = torch_bench.BenchConfig(shard_counts=(4,), block_bytes=1024 * KiB)
    samples = 4 * config.shard_bytes // config.sample_bytes
    compute_s = samples // config.batch_size * config.compute_s
    in_order, shuffled = list(range(samples)), torch_bench.epoch_order(samples, config.seed)
    # 80 MiB/s of samples over a 125 MB/s link: fetched sample by sample, or in order, the link keeps up.
    assert torch_bench.link_bound_s(shuffled, config, config.sample_bytes) == pytest.approx(compute_s, rel=0.05)
    assert torch_bench.link_bound_s(in_order, config, config.block_bytes) == pytest.approx(compute_s, rel=0.05)
    # In 1 MiB blocks, a random order needs most blocks in the epoch's first batches.
    assert torch_bench.link_bound_s(shuffled, config, config.block_bytes) > 1.2 * compute_s


def test_bound_without_a_plan_lies_between_the_bound_with_one_and_a_round_trip_per_sample() -> None:
    config = torch_bench.BenchConfig(shard_counts=(4,))
    samples = 4 * config.shard_bytes // config.sample_bytes
    compute_s = samples // config.batch_size * config.compute_s
    shuffled = torch_bench.epoch_order(samples, config.seed)
    without = torch_bench.no_plan_bound_s(shuffled, config, config.block_size)
    # Workers waiting a round trip for every sample, none filled in time: the loader's slowest.
    one_by_one_s = samples * config.rtt_ms / 1000 / config.workers
    assert torch_bench.link_bound_s(shuffled, config, config.block_size) < without < one_by_one_s
    instant = dataclasses.replace(config, rtt_ms=0.0, rate_mbit=None)
    assert torch_bench.no_plan_bound_s(shuffled, instant, instant.block_size) == pytest.approx(compute_s)
