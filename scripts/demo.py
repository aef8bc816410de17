"""`make demo`: a hub on a sample dataset, a spoke mounted over it, a cold and a warm read.

Everything lives in a temporary directory and is cleaned up on exit, also
when a step fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from cachefs.bench.workloads import drop_page_cache

log = logging.getLogger("demo")
BIN = Path(sys.executable).parent
MiB = 1 << 20


def make_dataset(root: Path) -> int:
    """A few large shards and a tree of small files; returns the byte count."""
    rng = random.Random(42)
    total = 0
    shards = root / "shards"
    shards.mkdir(parents=True)
    for index in range(4):
        data = rng.randbytes(24 * MiB + rng.randrange(MiB))
        (shards / f"train-{index:05d}.bin").write_bytes(data)
        total += len(data)
    for directory in range(5):
        sub = root / "samples" / f"class-{directory}"
        sub.mkdir(parents=True)
        for index in range(40):
            data = rng.randbytes(rng.randrange(1, 200_000))
            (sub / f"sample-{index:03d}.jpg").write_bytes(data)
            total += len(data)
    (root / "README.txt").write_text("A sample dataset served by cachefs-hub.\n")
    return total


@contextlib.contextmanager
def running_hub(root: Path, log_path: Path) -> Iterator[str]:
    with open(log_path, "w") as hub_log:
        hub = subprocess.Popen(
            [BIN / "cachefs-hub", "serve", "--root", root, "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=hub_log,
            text=True,
        )
    try:
        assert hub.stdout is not None
        line = hub.stdout.readline()
        if "listening on " not in line:
            raise SystemExit("demo: the hub did not start")
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        hub.terminate()
        hub.wait(timeout=20)


@contextlib.contextmanager
def mounted(url: str, mountpoint: Path, cache_dir: Path) -> Iterator[None]:
    run([BIN / "cachefs", "mount", url, mountpoint, "--cache-dir", cache_dir, "--cache-size", "1G"])
    try:
        yield
    finally:
        result = subprocess.run([BIN / "cachefs", "unmount", mountpoint])
        if result.returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", mountpoint])


def run(command: list[object]) -> None:
    subprocess.run([str(part) for part in command], check=True)


def read_and_verify(mountpoint: Path, source: Path) -> tuple[int, float]:
    """Read every file through the mount and compare with the source; (bytes, seconds)."""
    total = 0
    started = time.perf_counter()
    for directory, _dirs, files in os.walk(source):
        for name in files:
            original = Path(directory) / name
            through_mount = mountpoint / original.relative_to(source)
            data = through_mount.read_bytes()
            if data != original.read_bytes():
                raise SystemExit(f"demo: MISMATCH in {through_mount}")
            total += len(data)
    return total, time.perf_counter() - started


def report(label: str, size: int, seconds: float) -> None:
    print(f"\n== {label}: read and verified {size / MiB:.1f} MiB in {seconds:.2f} s "
          f"({size / MiB / seconds:.0f} MiB/s), every byte identical to the source")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="demo: %(message)s")
    workdir = Path(tempfile.mkdtemp(prefix="cachefs-demo-"))
    try:
        source, mountpoint, cache_dir = workdir / "dataset", workdir / "mnt", workdir / "cache"
        mountpoint.mkdir()
        size = make_dataset(source)
        print(f"== sample dataset: {size / MiB:.1f} MiB in {source}")
        with running_hub(source, workdir / "hub.log") as url:
            print(f"== hub serving it on {url}")
            with mounted(url, mountpoint, cache_dir):
                report("cold read (every block crosses the network)", *read_and_verify(mountpoint, source))
                run([BIN / "cachefs", "stats", mountpoint])
                dropped = drop_page_cache()
                label = "warm read (page cache dropped: from the local block cache)" if dropped else "warm read"
                report(label, *read_and_verify(mountpoint, source))
                run([BIN / "cachefs", "stats", mountpoint])
        print("\n== unmounted and hub stopped; demo passed")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
