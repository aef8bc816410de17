"""Warm read throughput of one large file: straight from a cachefs mount, and over NFSv3/v4
from `cachefs export` (NFS-Ganesha) on loopback, read by libnfs's nfs-cat.

    sudo .venv/bin/python scripts/bench_nfs_export.py --size-mib 256 --runs 5

Runs a hub and a spoke on this machine, warms the file into the spoke's cache,
and starts Ganesha in a network namespace of its own (the tests' harness,
tests/nfs_helpers.py: rpcbind for NFSv3 without touching the host's port
111). Each run drops the file's pages from the kernel's page cache first, so
every read goes through the daemon and its cache; the ways are run in turn,
and the median of each is printed. Needs root, nfs-ganesha, nfs-ganesha-vfs,
rpcbind and libnfs-utils.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hub_helpers import running_hub  # noqa: E402
from mount_helpers import evict_from_page_cache, mounted_spoke, run_cachefs  # noqa: E402
from nfs_helpers import nfs_namespace  # noqa: E402

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-nfs-") as work:
        workdir = Path(work)
        source = workdir / "data"
        source.mkdir()
        with open(source / "big.bin", "wb") as out:
            for _ in range(args.size_mib):
                out.write(os.urandom(MiB))
        size = args.size_mib * MiB
        with running_hub(source) as hub, mounted_spoke(hub.url, workdir, ("--allow-other", "--nfs-export")) as spoke:
            warm = run_cachefs("warm", spoke.mountpoint / "big.bin", timeout_s=600)
            assert warm.returncode == 0, warm.stderr
            with nfs_namespace(workdir) as ns:
                ns.start_ganesha(spoke.mountpoint)
                file = spoke.mountpoint / "big.bin"
                ways = {
                    "fuse (dd bs=1M)": ["dd", f"if={file}", "of=/dev/null", "bs=1M"],
                    "nfsv3 (nfs-cat)": ns.command(["sh", "-c", f"nfs-cat 'nfs://127.0.0.1{file}?version=3' >/dev/null"]),
                    "nfsv4 (nfs-cat)": ns.command(["sh", "-c", f"nfs-cat 'nfs://127.0.0.1{file}?version=4' >/dev/null"]),
                }
                seconds: dict[str, list[float]] = {way: [] for way in ways}
                for _ in range(args.runs):
                    for way, command in ways.items():
                        assert evict_from_page_cache([file], timeout_s=10)
                        started = time.perf_counter()
                        subprocess.run(command, check=True, capture_output=True, timeout=600)
                        seconds[way].append(time.perf_counter() - started)
        for way, times in seconds.items():
            rates = sorted(size / t / 1e6 for t in times)
            print(f"{way:18s} median {statistics.median(rates):7.0f} MB/s  (runs: {', '.join(f'{r:.0f}' for r in rates)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
