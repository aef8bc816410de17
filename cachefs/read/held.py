"""Block bytes held in daemon memory: one store, an owner per entry, each owner within its share of the budget.

A block's bytes are held from the moment they arrive from the hub (while
the cache writer commits them: readers of its flight take them from here)
until their owner lets go:

- `DEMAND`: blocks readers used lately, least recently used first out, so
  the kernel's several smaller requests into one block cost one disk read;
- `READ_AHEAD`: blocks read-ahead fetched before their first read, kept
  until that read (written with O_DIRECT, they are not in the page cache);
- `PLAN`: blocks prefetched along a loader's plan, kept until their planned
  use (the planner bounds them, in flight and held, by its share);
- `WARM`: an operator's warm-up, held only until written.

A reader that uses a block takes it over as `DEMAND`. Every call runs on
the trio thread, except `note_of`, which the cache writer's thread may call
(one dict read).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Iterator
from typing import Protocol

from ..cache import BlockData, BlockKey
from ..config import MemoryBudget


class Owner(enum.Enum):
    DEMAND = "demand"
    READ_AHEAD = "read-ahead"
    PLAN = "plan"
    WARM = "warm"


class HoldNote(Protocol):
    """What an owner learns about one of its held blocks (the planner counts its prefetch with it)."""

    def wanted(self) -> bool:
        """Whether the block is still worth holding once written."""
        ...

    def used(self) -> None:
        """A reader took the block."""
        ...

    def wasted(self) -> None:
        """The block was dropped unread."""
        ...


@dataclasses.dataclass(slots=True)
class Held:
    data: BlockData
    owner: Owner
    since_s: float  # when it arrived or was last used (trio clock)
    writing: bool  # on its way to the cache: held whatever the owner's share, until written
    cached: bool = False  # the cache has it too (so a held read-ahead block is readable from disk)
    note: HoldNote | None = None


class HeldBlocks:
    """The daemon's only store of block bytes in memory (see the module's docstring)."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self._entries: dict[BlockKey, Held] = {}
        # Per owner, oldest first (DEMAND: least recently used first).
        self._order: dict[Owner, collections.OrderedDict[BlockKey, None]] = {
            owner: collections.OrderedDict() for owner in Owner
        }
        self._bytes: collections.Counter[Owner] = collections.Counter()
        self._writing_bytes: collections.Counter[Owner] = collections.Counter()  # of those, on their way to the cache
        # DEMAND's blocks the cache writer is done with, least recently used first: the only
        # ones trimming may drop, kept apart so that a trim on every read does not step over
        # the many a walk's readers took while they were still being written.
        self._demand_settled: collections.OrderedDict[BlockKey, None] = collections.OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def bytes_of(self, owner: Owner, *, writing: bool = True) -> int:
        """Bytes held for `owner` (without `writing`: only those the cache writer is done with)."""
        return self._bytes[owner] if writing else self._bytes[owner] - self._writing_bytes[owner]

    def bytes_by_owner(self) -> dict[str, int]:
        """Bytes held per owner, every owner named (the metrics' gauge; any thread: a read of
        ints the trio thread updates)."""
        return {owner.value: self._bytes[owner] for owner in Owner}

    def keys_of(self, owner: Owner) -> Iterator[tuple[BlockKey, Held]]:
        """The owner's entries, oldest first (a copy: the caller may drop some)."""
        for key in list(self._order[owner]):
            yield key, self._entries[key]

    def note_of(self, key: BlockKey, owner: Owner) -> HoldNote | None:
        """The note of the block if `owner` holds it (any thread: one dict read)."""
        held = self._entries.get(key)
        return held.note if held is not None and held.owner is owner else None

    # -- arrivals -------------------------------------------------------------------

    def arrived(self, key: BlockKey, data: BlockData, owner: Owner, now: float, note: HoldNote | None = None) -> None:
        """A fetched block's verified bytes, held while the cache writer commits them."""
        self.drop(key)
        self._add(key, Held(data, owner, now, writing=True, note=note))

    def settled(self, key: BlockKey, now: float, *, cached: bool, claimed: bool, discarded: bool) -> None:
        """The cache writer is done with the block (or it will not be written): its owner's
        share decides whether it stays. `claimed`: read-ahead still waits for its first read;
        `discarded`: an evict or purge dropped it meanwhile."""
        held = self._entries.get(key)
        if held is None or not held.writing:
            return
        held.writing = False
        self._writing_bytes[held.owner] -= len(held.data)
        if held.owner is Owner.DEMAND:
            self._demand_settled[key] = None
        held.cached = cached
        keep = {
            Owner.DEMAND: True,
            Owner.READ_AHEAD: claimed,
            Owner.PLAN: held.note is None or held.note.wanted(),
            Owner.WARM: False,
        }[held.owner]
        if discarded or not keep:
            self.drop(key)
        elif held.owner is Owner.DEMAND:
            self._trim_demand()
        elif held.owner is Owner.READ_AHEAD:
            self._fit_read_ahead(key, held, now)

    # -- readers --------------------------------------------------------------------

    def get(self, key: BlockKey) -> BlockData | None:
        """The block's bytes if held, without taking them over."""
        held = self._entries.get(key)
        return held.data if held is not None else None

    def use(self, key: BlockKey, now: float) -> BlockData | None:
        """A reader uses the block: its bytes if held, which become DEMAND's (most recently used)."""
        held = self._entries.get(key)
        if held is None:
            return None
        if held.owner is not Owner.DEMAND:
            if held.note is not None:
                held.note.used()
            self._retag(key, held, Owner.DEMAND)
        else:
            self._order[Owner.DEMAND].move_to_end(key)
            if key in self._demand_settled:
                self._demand_settled.move_to_end(key)
        held.since_s = now
        held.note = None
        self._trim_demand()
        return held.data

    def expire_unread(self, now: float) -> None:
        """Drop read-ahead blocks left unread `read_ahead_max_age_s` (called on a period:
        new read-ahead blocks push old ones out, but read-ahead may have gone quiet, as it
        does for files a loader's plan covers)."""
        self.expire(Owner.READ_AHEAD, now, self._budget.read_ahead_max_age_s)

    def drop_read_ahead(self, file_id: bytes, version: bytes) -> list[BlockKey]:
        """Drop a file version's blocks held for their first read (those written already): the
        kernel reads the file from the cache itself (passthrough). Returns their keys."""
        dropped = [key for key in self._order[Owner.READ_AHEAD]
                   if key.file_id == file_id and key.version == version and not self._entries[key].writing]
        for key in dropped:
            self.drop(key)
        return dropped

    def remember(self, key: BlockKey, data: BlockData, now: float) -> None:
        """A block a reader just read from disk, as DEMAND's most recently used."""
        if key not in self._entries:
            self._add(key, Held(data, Owner.DEMAND, now, writing=False))
            self._trim_demand()

    # -- letting go -----------------------------------------------------------------

    def drop(self, key: BlockKey) -> BlockData | None:
        """Forget a block (its note hears it was wasted unless a reader had it); its bytes, if held."""
        held = self._entries.pop(key, None)
        if held is None:
            return None
        del self._order[held.owner][key]
        self._demand_settled.pop(key, None)
        self._bytes[held.owner] -= len(held.data)
        if held.writing:
            self._writing_bytes[held.owner] -= len(held.data)
        if held.note is not None:
            held.note.wasted()
        return held.data

    def discard(self, predicate: Callable[[BlockKey], bool]) -> None:
        """Drop the blocks `predicate` picks that are not on their way to the cache (evict, purge:
        those are dropped when written, as the fetcher marks them)."""
        for key in [key for key, held in self._entries.items() if not held.writing and predicate(key)]:
            self.drop(key)

    def expire(self, owner: Owner, now: float, age_s: float) -> None:
        """Drop the owner's blocks held `age_s` or longer (not those being written)."""
        expired = []
        for key in self._order[owner]:  # oldest first: only the expired ones are looked at
            held = self._entries[key]
            if now - held.since_s < age_s:
                break
            if not held.writing:
                expired.append(key)
        for key in expired:
            self.drop(key)

    # -- shares ---------------------------------------------------------------------

    def _add(self, key: BlockKey, held: Held) -> None:
        self._entries[key] = held
        self._order[held.owner][key] = None
        if held.owner is Owner.DEMAND and not held.writing:
            self._demand_settled[key] = None
        self._bytes[held.owner] += len(held.data)
        if held.writing:
            self._writing_bytes[held.owner] += len(held.data)

    def _retag(self, key: BlockKey, held: Held, owner: Owner) -> None:
        del self._order[held.owner][key]
        self._bytes[held.owner] -= len(held.data)
        if held.writing:
            self._writing_bytes[held.owner] -= len(held.data)
        self._demand_settled.pop(key, None)
        held.owner = owner
        self._order[owner][key] = None
        if owner is Owner.DEMAND and not held.writing:
            self._demand_settled[key] = None
        self._bytes[owner] += len(held.data)
        if held.writing:
            self._writing_bytes[owner] += len(held.data)

    def _trim_demand(self) -> None:
        """Least recently used DEMAND blocks out while over its share in bytes or blocks (not those being written)."""
        budget = self._budget
        excess_bytes = self._bytes[Owner.DEMAND] - budget.demand_bytes
        excess_blocks = len(self._order[Owner.DEMAND]) - budget.demand_blocks
        out: list[BlockKey] = []
        for key in self._demand_settled:
            if excess_bytes <= 0 and excess_blocks <= 0:
                break
            out.append(key)
            excess_bytes -= len(self._entries[key].data)
            excess_blocks -= 1
        for key in out:
            self.drop(key)

    def _fit_read_ahead(self, key: BlockKey, held: Held, now: float) -> None:
        """Keep a written read-ahead block within read-ahead's share, or drop it.

        A stream reads its blocks oldest first, so when the share is used up
        the newest block is not kept; except that blocks held
        `read_ahead_stale_s` or longer make room (a wrong guess of a reader's
        next file, a stream given up: nobody is coming for them), and that a
        block the cache did not admit takes the place of the newest cached
        ones (those can be read from disk). Blocks left unread expire after
        `read_ahead_max_age_s`.
        """
        budget = self._budget
        self.expire(Owner.READ_AHEAD, now, budget.read_ahead_max_age_s)
        if key not in self._entries:
            return
        size = len(held.data)
        held.since_s = now
        self._order[Owner.READ_AHEAD].move_to_end(key)

        def others() -> int:
            return self._settled_read_ahead_bytes() - size

        if others() + size <= budget.read_ahead_held_bytes:
            return
        for old_key, old in self.keys_of(Owner.READ_AHEAD):  # the stale make room, only as much as needed
            if others() + size <= budget.read_ahead_held_bytes or now - old.since_s < budget.read_ahead_stale_s:
                break
            if old_key != key and not old.writing:
                self.drop(old_key)
        if not held.cached and others() + size > budget.read_ahead_held_bytes:
            cached = [k for k, h in reversed(list(self.keys_of(Owner.READ_AHEAD)))
                      if k != key and h.cached and not h.writing]
            if others() - sum(len(self._entries[k].data) for k in cached) + size <= budget.read_ahead_held_bytes:
                for cached_key in cached:
                    if others() + size <= budget.read_ahead_held_bytes:
                        break
                    self.drop(cached_key)
        if others() + size > budget.read_ahead_held_bytes:
            self.drop(key)

    def _settled_read_ahead_bytes(self) -> int:
        """Read-ahead's held bytes that count against its share (those written)."""
        return self._bytes[Owner.READ_AHEAD] - self._writing_bytes[Owner.READ_AHEAD]
