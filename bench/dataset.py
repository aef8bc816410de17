"""The benchmark dataset: random shards (`shards/*.bin`) and a tree of small files (`small/<dir>/<file>`).

A finished dataset carries a marker file with its spec, so a later run with
the same spec and `--dataset-dir` reuses it instead of writing gigabytes again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

MiB = 1024 * 1024
KiB = 1024
MARKER = ".cachefs-bench-dataset.json"
WRITE_CHUNK_BYTES = 4 * MiB


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Sizes of the generated dataset."""

    shard_count: int
    shard_bytes: int
    small_files: int
    small_dirs: int
    small_mean_bytes: int  # sizes are uniform in [mean/2, 3*mean/2]
    seed: int = 0

    @property
    def shard_total_bytes(self) -> int:
        return self.shard_count * self.shard_bytes


QUICK_SPEC = DatasetSpec(shard_count=16, shard_bytes=128 * MiB, small_files=2000, small_dirs=100,
                         small_mean_bytes=100 * KiB)
FULL_SPEC = DatasetSpec(shard_count=32, shard_bytes=128 * MiB, small_files=20000, small_dirs=100,
                        small_mean_bytes=100 * KiB)


def _write_random(path: Path, size_bytes: int) -> None:
    with open(path, "wb") as stream:
        left = size_bytes
        while left:
            chunk = min(left, WRITE_CHUNK_BYTES)
            stream.write(os.urandom(chunk))
            left -= chunk


def _matches(root: Path, spec: DatasetSpec) -> bool:
    try:
        return json.loads((root / MARKER).read_text()) == dataclasses.asdict(spec)
    except (OSError, ValueError):
        return False


def build_dataset(root: Path, spec: DatasetSpec) -> Path:
    """Write the dataset under `root` (replacing whatever is there), or reuse a finished one of the same spec."""
    if _matches(root, spec):
        log.info("reusing dataset %s", root)
        return root
    if root.exists():
        shutil.rmtree(root)
    began = time.monotonic()
    rng = random.Random(spec.seed)
    shards = root / "shards"
    shards.mkdir(parents=True)
    for index in range(spec.shard_count):
        _write_random(shards / f"train-{index:05d}.bin", spec.shard_bytes)
    for index in range(spec.small_files):
        directory = root / "small" / f"d{index % spec.small_dirs:03d}"
        directory.mkdir(parents=True, exist_ok=True)
        size = rng.randrange(spec.small_mean_bytes // 2, spec.small_mean_bytes * 3 // 2 + 1)
        _write_random(directory / f"sample-{index:06d}.jpg", size)
    os.sync()
    (root / MARKER).write_text(json.dumps(dataclasses.asdict(spec)) + "\n")
    log.info("dataset %s written in %.0f s", root, time.monotonic() - began)
    return root
