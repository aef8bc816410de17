"""A generated dataset exercising every shape the mount must handle."""

from __future__ import annotations

import os
import random
from pathlib import Path

KiB = 1024
MiB = 1024 * KiB

# Block size the mount tests use: small, so modest files span many blocks.
TEST_BLOCK_SIZE = 64 * KiB


def make_dataset(root: Path, seed: int = 7) -> Path:
    """Large files with odd sizes, many small files, nested and empty dirs,
    empty files, symlinks, names with spaces, UTF-8 and bytes that are not UTF-8."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    big = root / "shards"
    big.mkdir()
    for index, size in enumerate([3 * MiB + 17, 2 * MiB, TEST_BLOCK_SIZE, TEST_BLOCK_SIZE - 1, TEST_BLOCK_SIZE + 1]):
        (big / f"shard-{index:03d}.bin").write_bytes(rng.randbytes(size))
    for directory in range(4):
        sub = root / "small" / f"dir {directory}"
        sub.mkdir(parents=True)
        for index in range(25):
            (sub / f"file-{index:02d}.dat").write_bytes(rng.randbytes(rng.randrange(1, 40 * KiB)))
    deep = root / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "leaf.txt").write_text("deep leaf\n")
    (root / "empty-dir").mkdir()
    (root / "empty.bin").write_bytes(b"")
    (root / "naïve café ☕.txt").write_text("unicode name\n", encoding="utf-8")
    (root / "with space.txt").write_text("a name with a space\n")
    (root / os.fsdecode(b"not-utf8-\xff\xfe.bin")).write_bytes(rng.randbytes(1000))  # a name that is not UTF-8
    os.symlink("shards/shard-000.bin", root / "link-to-shard")
    os.symlink("a/b", root / "link-to-dir")
    return root


def source_files(root: Path) -> list[Path]:
    """Regular files below root (not following symlinks), relative paths."""
    found = []
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                found.append(path.relative_to(root))
    return sorted(found)
