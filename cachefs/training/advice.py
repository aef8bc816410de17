"""The plans being followed, as the cache's eviction advisor and read-ahead's judge of which files they cover."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ..cache import BlockKey
from ..cache.plan_eviction import INFINITE
from ..namespace.tree import Inode
from ..read.held import HeldBlocks, Owner
from .plans import Plan


@dataclasses.dataclass(slots=True)
class PlanHold:
    """The note of a block prefetched for a plan's use at `position` and held for it (HeldBlocks)."""

    plan: Plan
    position: int

    def wanted(self) -> bool:
        """Still to come: the plan neither ended nor moved past the use, nor did a reader consume it."""
        plan = self.plan
        return not plan.cancelled and self.position >= plan.tail and not plan.consumed_at(self.position)

    def used(self) -> None:
        self.plan.used_blocks += 1

    def wasted(self) -> None:
        self.plan.wasted_blocks += 1


class ActivePlans:
    """The plans being followed, and what they tell the cache about a block's next use.

    The cache's eviction advisor (cache/plan_eviction.py) and read-ahead's
    judge of which files a plan covers. The planner adds and ends plans on
    the trio thread; the cache writer's worker thread reads them
    (`distance`, `victim_hints`, `requeue_hints`) through copies of the
    dict's values and single dict reads, never iterating a live dict.
    """

    def __init__(self, held: HeldBlocks) -> None:
        self.plans: dict[int, Plan] = {}
        self._held = held

    def active(self) -> bool:
        return bool(self.plans)

    def covers(self, inode: Inode) -> bool:
        """Whether an active plan reads this file (read-ahead then stays off it)."""
        return any(plan.covers(inode) for plan in self.plans.values())

    def distance(self, key: BlockKey) -> int:
        """The cache asks (any thread): planned uses until the block's next use, over all plans.

        For a block held in memory for its planned use, that use is covered:
        what counts for the cache is the use after it.
        """
        hold = self._held.note_of(key, Owner.PLAN)
        best = INFINITE
        for plan in list(self.plans.values()):
            if isinstance(hold, PlanHold) and hold.plan is plan:
                best = min(best, plan.distance_after(hold.position, key))
            else:
                best = min(best, plan.distance(key))
        return best

    def victim_hints(self) -> Iterator[BlockKey]:
        """The cache asks (any thread): blocks the plans have finished with, oldest first."""
        for plan in list(self.plans.values()):
            while True:
                try:
                    entry = plan.released.popleft()
                except IndexError:
                    break
                yield plan.block_key(entry)

    def requeue_hints(self, keys: list[BlockKey]) -> None:
        """Hints taken but not used as victims, for a later decision (any thread)."""
        for key in keys:
            for plan in list(self.plans.values()):
                entry = plan.key_of(key)
                if entry is not None:
                    plan.released.append(entry)
                    break
