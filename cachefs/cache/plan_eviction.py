"""Admission and eviction while a loader's plan is active: Belady's rule, with the plan as the future.

Belady's optimal policy evicts the block whose next use is furthest away.
A plan (planner.py) says, for every block in its horizon, where its next
use is; blocks it does not use again are infinitely far. So, when a full
cache is offered a block:

- the victim is the cached, unpinned block with the furthest next use:
  first a block the plan has finished with (the planner hands these out as
  *hints*, at O(1) each), else the furthest of a sample of the oldest
  blocks;
- the block is admitted only if its own next use is sooner than the
  victim's. A block the plan does not use again (a demand miss being read
  for the last time, data of a job without a plan) never displaces a block
  a plan still needs; against a victim no plan needs either, it competes
  as before: TinyLFU, its frequency against the victim's.

Each decision costs a few LMDB reads and dict lookups, never a scan of the
cache: at most `MAX_SAMPLE_BLOCKS` candidates per batch of admissions.
`PlanVictims` is the candidate source BlockCache._admit uses while a plan
is active (`Victims` is what it asks of one; TinyLFU's is in block_cache.py).
"""

from __future__ import annotations

import heapq
import itertools
import sys
from collections.abc import Container, Iterator
from typing import TYPE_CHECKING, Protocol

from .keys import BlockKey

if TYPE_CHECKING:
    from .block_cache import BlockCache

INFINITE = sys.maxsize  # the distance of a block no plan uses again
# Oldest blocks examined at first when no hint is at hand: with blocks used
# in shuffled order, the best of 64 is within the furthest ~2 % of uses.
SAMPLE_BLOCKS = 64
MAX_SAMPLE_BLOCKS = 256
HINTS_PER_PULL = 16  # hints checked at a time (some are stale: evicted or used again)


class EvictionAdvisor(Protocol):
    """What the cache asks the planner; called from the cache writer's worker thread."""

    def active(self) -> bool: ...

    def distance(self, key: BlockKey) -> int:
        """Planned reads until the block's next use; INFINITE if none."""
        ...

    def victim_hints(self) -> Iterator[BlockKey]:
        """Blocks the plans have just finished with (candidates of infinite distance), consumed as yielded."""
        ...

    def requeue_hints(self, keys: list[BlockKey]) -> None:
        """Hints taken but not used as victims, for a later decision."""
        ...


class Victims(Protocol):
    """Candidates for eviction during one batch of admissions (BlockCache._admit)."""

    def best(self) -> tuple[BlockKey, int] | None:
        """(key, length) of the best victim, without taking it; None if there is none."""
        ...

    def displaces(self, key: BlockKey, victim: BlockKey, ahead: Container[BlockKey] = ()) -> bool:
        """Whether `key` deserves the victim's place (blocks in `ahead`, offered or cached, were
        fetched before their first read: it counts as read once more, the read is on its way)."""
        ...

    def take(self) -> None:
        """The best victim was evicted."""
        ...

    def refused(self) -> None:
        """The best victim kept its place against the block offered."""
        ...

    def done(self) -> None:
        """The batch of admissions is over."""
        ...


class PlanVictims:
    """Candidates for one batch of admissions, furthest next use first."""

    def __init__(self, cache: BlockCache, advisor: EvictionAdvisor) -> None:
        self._cache = cache
        self._advisor = advisor
        self._hints = advisor.victim_hints()
        self._oldest = cache._victims()
        self._sampled = 0
        self._heap: list[tuple[int, int, int, BlockKey, int, bool]] = []  # -distance, frequency, seq, key, length, hint
        self._known: set[BlockKey] = set()
        self._seq = itertools.count()
        self._offered: tuple[BlockKey, int] | None = None  # the block being admitted and its distance

    def best(self) -> tuple[BlockKey, int] | None:
        if not self._heap or -self._heap[0][0] < INFINITE:
            self._pull_hints()
        while (not self._heap or -self._heap[0][0] < INFINITE) and self._sample_more():
            pass
        if not self._heap:
            return None
        _negative_distance, _frequency, _seq, key, length, _hint = self._heap[0]
        return key, length

    def displaces(self, key: BlockKey, victim: BlockKey, ahead: Container[BlockKey] = ()) -> bool:
        """Belady: needed sooner than the victim; if neither is planned again, TinyLFU."""
        if self._offered is None or self._offered[0] != key:
            self._offered = (key, self._advisor.distance(key))
        distance, victim_distance = self._offered[1], -self._heap[0][0]
        if distance < victim_distance:
            return True
        if distance == victim_distance == INFINITE:
            return self._cache.sketch.admits(key, victim, ahead)
        return False  # the victim is needed again, the block offered is not needed sooner

    def take(self) -> None:
        heapq.heappop(self._heap)

    def refused(self) -> None:
        pass  # still the best victim for the next block offered

    def done(self) -> None:
        """Hand back the hints taken but not used."""
        leftover = [key for _d, _f, _s, key, _l, hint in self._heap if hint]
        if leftover:
            self._advisor.requeue_hints(leftover)

    def _push(self, key: BlockKey, length: int, distance: int, hint: bool) -> None:
        self._known.add(key)
        heapq.heappush(self._heap, (-distance, self._cache.sketch.estimate(key), next(self._seq), key, length, hint))

    def _pull_hints(self) -> None:
        for key in itertools.islice(self._hints, HINTS_PER_PULL):
            if key in self._known or self._cache.is_pinned(key.file_id):
                continue
            entry = self._cache.index.get(key)
            if entry is None:
                continue  # evicted meanwhile
            distance = self._advisor.distance(key)
            if distance == INFINITE:
                self._push(key, entry.length, distance, hint=True)
                return

    def _sample_more(self) -> bool:
        """Add up to SAMPLE_BLOCKS of the oldest blocks; False when there are no more to look at."""
        if self._sampled >= MAX_SAMPLE_BLOCKS:
            return False
        added = 0
        for key, length in self._oldest:
            self._sampled += 1
            if key not in self._known:
                self._push(key, length, self._advisor.distance(key), hint=False)
                added += 1
            if added >= SAMPLE_BLOCKS or self._sampled >= MAX_SAMPLE_BLOCKS:
                return True
        self._sampled = MAX_SAMPLE_BLOCKS  # the cache holds no more
        return added > 0
