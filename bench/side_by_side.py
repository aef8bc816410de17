"""Warm sequential reads through a mount and from the local disk, alternated round by round.

On a virtual machine one read of the same files, page cache dropped each
time, is not like the next: here 512 MiB of local shards read at 860 MB/s
once (1.0 s of kernel time: memory the host had taken back is faulted in
again) and at 2.1-2.2 GB/s (0.16 s) right after. The full run's local
baseline and its warm run are minutes apart, so their ratio said little
(44 % in one run, 145 % in another). A warm mount is compared here with
local reads of the same minute: `rounds` rounds, the page cache dropped
before every read, local and mount taking turns to go first; the medians
of each side, which an odd slow read does not move, and their ratio count.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from cachefs.bench.workloads import drop_page_cache, find_dataset, sequential_read

log = logging.getLogger(__name__)

ROUNDS = 5
WORKLOADS = (("seq1", 1), ("seq4", 4))  # the read of each, as `cachefs bench` does it: files and threads
SIDES = ("local", "mount")


def alternate(local_root: Path, mount_root: Path, time_limit_s: float, rounds: int = ROUNDS) -> dict[str, Any]:
    """{"rounds": n, "seq1": {"local": {"mb_per_s": [...], "median": x}, "mount": {...}}, "seq4": ...}."""
    datasets = {"local": find_dataset(local_root, with_small=False), "mount": find_dataset(mount_root, with_small=False)}
    result: dict[str, Any] = {"rounds": rounds}
    for name, threads in WORKLOADS:
        rates: dict[str, list[float]] = {side: [] for side in SIDES}
        for round_index in range(rounds):
            for side in SIDES if round_index % 2 == 0 else reversed(SIDES):
                drop_page_cache()
                read = sequential_read(datasets[side].large_group(name), threads, time_limit_s)
                rates[side].append(read.mb_per_s)
        result[name] = {side: {"mb_per_s": values, "median": statistics.median(values)} for side, values in rates.items()}
        log.info("side by side, %s: local %s, mount %s MB/s", name,
                 *(" / ".join(f"{rate:.0f}" for rate in rates[side]) for side in SIDES))
    return result
