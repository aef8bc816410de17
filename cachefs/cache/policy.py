"""Admission by frequency (TinyLFU): which block deserves a place in a full cache.

LRU, FIFO and CLOCK all fall to a 0 % hit ratio when training epochs loop
over a dataset larger than the cache: each block is evicted just before its
next use. TinyLFU keeps a compact count of recent accesses (a count-min
sketch) and, when the cache is full, admits a new block only if it was used
more often before the use that fetched it than the block it would evict was
in all (`admits`). In a loop every block has the same count, so the
incumbents stay and each epoch hits on cache/dataset of its reads, the best
any policy can do without knowing the future. A one-time scan by another
job never displaces blocks in use. Counts are halved every `aging_accesses`
accesses, so a new working set that is read repeatedly takes over from an
old one.

The sketch is saved in the cache dir and survives restarts.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Container
from pathlib import Path

import xxhash

from .keys import BlockKey

log = logging.getLogger(__name__)

ROWS = 4
# Counters per row at most: 64 MiB of sketch in all (a cache of 16 M blocks gets two
# counters per block; a larger one shares them, so counts of rare blocks run a little
# high). Unbounded, --cache-size 100T at 64K blocks would take 1 GB.
MAX_WIDTH = 1 << 24
_HEADER = struct.Struct(">4sIQQ")  # magic, rows, width, accesses since aging
_MAGIC = b"CFS1"
_HALVED = bytes(count >> 1 for count in range(256))


class FrequencySketch:
    """Count-min sketch of 8-bit saturating counters over BlockKeys."""

    def __init__(self, capacity_blocks: int) -> None:
        # Width: a power of two at least twice the blocks the cache holds,
        # so collisions rarely inflate a count (4 rows x 2 bytes per block).
        self.width = min(MAX_WIDTH, 1 << max(10, (2 * max(1, capacity_blocks) - 1).bit_length()))
        self.counters = bytearray(ROWS * self.width)
        # Halve all counts after this many accesses: ten passes over a full
        # cache, long enough to see a training loop repeat, short enough
        # that an abandoned working set fades within a few hours of use.
        self.aging_accesses = 10 * max(1, capacity_blocks)
        self.accesses = 0

    def _slots(self, key: BlockKey) -> list[int]:
        digest = xxhash.xxh3_128_intdigest(key.packed())
        mask = self.width - 1
        return [row * self.width + ((digest >> (32 * row)) & mask) for row in range(ROWS)]

    def record(self, key: BlockKey) -> None:
        """Count one access."""
        counters = self.counters
        for slot in self._slots(key):
            if counters[slot] < 255:
                counters[slot] += 1
        self.accesses += 1
        if self.accesses >= self.aging_accesses:
            self._age()

    def estimate(self, key: BlockKey) -> int:
        counters = self.counters
        return min(counters[slot] for slot in self._slots(key))

    def expected(self, key: BlockKey, ahead: Container[BlockKey]) -> int:
        """The block's count, plus one if it is in `ahead` (fetched ahead of its first read,
        not read yet): that read is on its way, and the sketch counts it only when it happens."""
        return self.estimate(key) + (key in ahead)

    def admits(self, key: BlockKey, victim: BlockKey, ahead: Container[BlockKey]) -> bool:
        """Whether a block offered to a full cache takes `victim`'s place: its uses before the
        one that fetched it outnumber all of the victim's (both counting a read on its way).

        The fetching use is left out because, part way through a loop's pass, it is
        counted for the block offered while the victim's use in the same pass is still
        to come: counting it let each block fetched displace one the reader needs next,
        and a cache not holding the loop's first blocks (read-ahead's writes land out of
        order) lost every hit, pass after pass."""
        return self.expected(key, ahead) - 1 > self.expected(victim, ahead)

    def _age(self) -> None:
        self.counters = bytearray(self.counters.translate(_HALVED))
        self.accesses = 0

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as out:
            out.write(_HEADER.pack(_MAGIC, ROWS, self.width, self.accesses))
            out.write(self.counters)
        os.replace(tmp, path)

    def load(self, path: Path) -> bool:
        """Restore counts saved by `save` (if the geometry matches)."""
        try:
            data = path.read_bytes()
            magic, rows, width, accesses = _HEADER.unpack_from(data)
        except (OSError, struct.error):
            return False
        if magic != _MAGIC or rows != ROWS or width != self.width or len(data) != _HEADER.size + ROWS * width:
            log.info("ignoring policy state in %s: made for another cache size", path)
            return False
        self.counters = bytearray(data[_HEADER.size :])
        self.accesses = accesses
        return True
