"""Counters of the spoke, shown by `cachefs stats`."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Stats:
    """Counters since mount. Plain ints: updated from the trio thread and
    worker threads with `+=`, which is fine for statistics."""

    reads: int = 0
    read_bytes: int = 0
    block_hits: int = 0  # blocks served from the local cache (disk or memory)
    block_misses: int = 0  # blocks a reader had to wait for the hub for
    fetches: int = 0  # block requests sent to the hub (demand + read-ahead)
    fetched_bytes: int = 0  # bytes received from the hub: the WAN cost
    readahead_fetches: int = 0
    fetch_retries: int = 0
    fetch_failures: int = 0  # reads that failed because the hub could not deliver
    corrupt_blocks: int = 0
    store_errors: int = 0
    evicted_blocks: int = 0
    rejected_blocks: int = 0  # fetched but not admitted to a full cache (less popular than what it holds)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
