"""Read-ahead's claims: the blocks it fetched whose first read is still to come, bounded in count and age."""

from __future__ import annotations

from ..cache import BlockKey

# A claim (admission counts the block's coming read; its read counts as
# read-ahead used) holds for this many blocks and this long after the block
# was asked for: a wrong guess of a reader's next file, or a stream given up,
# must not keep its blocks counted as coming (they would outweigh blocks
# readers used as eviction victims). 60 s: a window (at most 64 MiB) is read
# within it by any reader faster than ~1 MB/s; twice what read-ahead blocks
# are held in memory.
CLAIMS_REMEMBERED = 4096
CLAIM_MAX_AGE_S = 60.0


class ReadAheadClaims:
    """Blocks read ahead and not read yet, each with when it was asked for: at most
    `limit` of them (the oldest are forgotten), none asked for `max_age_s` ago or earlier."""

    def __init__(self, limit: int = CLAIMS_REMEMBERED, max_age_s: float = CLAIM_MAX_AGE_S) -> None:
        self._limit = limit
        self._max_age_s = max_age_s
        # A plain dict (in insertion order), not an OrderedDict: `current` copies it once
        # per cache write, and a set is made from a dict with the hashes it stores.
        self._asked: dict[BlockKey, float] = {}

    def add(self, key: BlockKey, now: float) -> None:
        self._asked.pop(key, None)
        self._asked[key] = now  # the newest last
        while len(self._asked) > self._limit:
            del self._asked[next(iter(self._asked))]
        self._expire(now)

    def pop(self, key: BlockKey) -> bool:
        """Whether the block was read ahead (and not read since); it is not any more."""
        return self._asked.pop(key, None) is not None

    def __contains__(self, key: object) -> bool:
        return key in self._asked

    def current(self, now: float) -> frozenset[BlockKey]:
        """The blocks whose read is still counted as coming."""
        self._expire(now)
        return frozenset(self._asked)

    def _expire(self, now: float) -> None:
        asked = self._asked
        while asked:
            oldest = next(iter(asked))
            if now - asked[oldest] < self._max_age_s:
                return
            del asked[oldest]
