"""Read-ahead's claims: the blocks it fetched whose first read is still to come, bounded in count and age."""

from __future__ import annotations

import collections

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
        self._asked: collections.OrderedDict[BlockKey, float] = collections.OrderedDict()

    def add(self, key: BlockKey, now: float) -> None:
        self._asked[key] = now
        self._asked.move_to_end(key)
        while len(self._asked) > self._limit:
            self._asked.popitem(last=False)
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
        while self._asked and now - next(iter(self._asked.values())) >= self._max_age_s:
            self._asked.popitem(last=False)
