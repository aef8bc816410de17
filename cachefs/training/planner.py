"""Follow loaders' plans: match every read to them, prefetch along them within the plan share of the memory budget.

A loader knows the order in which it will read its samples. `cachefs.plan`
(the client) sends that order for an epoch as (file, offset, length) reads
over the control socket; here each read becomes the blocks it touches, one
*entry* per block use, kept compactly (8 bytes an entry, spilled to
`<cache-dir>/plans/` beyond `MEMORY_CHUNKS` chunks, so a plan larger than
memory costs disk, not RAM).

- **Position.** The reader calls `observe` for every block it serves. A
  block matches its next unconsumed planned use within reach of the
  frontier; the plan's *head* is the furthest use matched, its *tail* the
  first use not yet consumed, and the tail never lags the head by more than
  `trail` uses (uses served from the kernel's page cache never reach the
  daemon; workers read out of order). A reader that comes for a use the
  tail passed (a DataLoader's workers each read a batch of their own, so
  8 x 64 samples are in progress at once) grows the trail to twice its
  lag, and later plans start with that trail. Readers that skipped a
  stretch the daemon never saw (the page cache served it; a resumed epoch
  skipped its first batches) are found again: `RESYNC_READS` unmatched
  reads in a row whose uses lie close together beyond reach move the plan
  to them. Reads a plan does not expect are
  counted and otherwise ignored, so a plan that lies costs at most one
  lookahead window of wasted prefetch, also counted.
- **Prefetch.** Blocks of the next `lookahead_blocks` uses after the head
  that are neither cached nor in flight are fetched in runs of contiguous
  blocks (up to config.RUN_BYTES), or of small files whole (a batch request,
  as many files as spread the lookahead over the connections), holding the
  fetcher's `prefetch_slots` like read-ahead, so demand
  misses always find a connection. Of those slots, only as many are used
  as keep the link busy: bytes in flight up to twice the bandwidth-delay
  product, from the shortest one-block fetch (the RTT) and the highest
  delivery rate of the last `LINK_WINDOW_S`. More would only share the
  link among more blocks and delay the one needed next. The lookahead
  is sized from measurement:
  the blocks readers consume during two fetch latencies (which hold the
  link's RTT and transfer time) plus `LOOKAHEAD_MARGIN_S` of jitter, doubled for
  a while whenever readers overtake the prefetch frontier, and bounded by
  the plan's share of the memory budget (config.MemoryBudget.plan_bytes):
  prefetched blocks are held in memory until their planned use, so blocks
  in flight plus blocks held stay within it.
- **Eviction.** The cache asks `distance(key)`: planned uses until the
  block's next use (infinite if none in any plan); for a block held for
  its next use, the use after that one, since the held copy covers the
  next. So prefetching never displaces a cached block that is needed
  before the prefetched one is needed again, and the cache's contents
  follow Belady's rule as if there were no prefetch. See
  cache/plan_eviction.py for the rule (over the plan's horizon).

A plan lives as long as its control connection: closing it (or the
process ending) cancels the plan, which stops its prefetch at once (runs
still waiting for a connection are dropped; at most `prefetch_slots`
requests finish). A plan whose every use was served ends by itself.
"""

from __future__ import annotations

import collections
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from ..cache import BlockCache, BlockKey
from ..config import RUN_BYTES, MemoryBudget, run_blocks
from ..control.server import Lines, Progress
from ..errors import CachefsError
from ..fetch.fetcher import Fetcher
from ..fetch.hub_client import BATCH_MAX_FILES
from ..fetch.runs import missing_runs
from ..metrics import Stats
from ..namespace.tree import Namespace
from ..prefetch.queue import logging_failure
from ..read.held import HeldBlocks, Owner
from .advice import ActivePlans, PlanHold
from .entries import EntryStore
from .link import RATE_SMOOTHING, LinkEstimate
from .plans import MIN_TRAIL_ENTRIES, Plan
from .protocol import cancel_when_closed, receive_plan
from .stats import TrainingStats

log = logging.getLogger(__name__)

PLANS_DIR = "plans"
MAX_PLANS = 64
# Epoch numbers stay exact as floats (Prometheus' cachefs_epoch gauge) and in JSON readers.
MAX_EPOCH = (1 << 53) - 1
# Entries indexed ahead of the tail for next-use lookups, shared by all
# plans: up to ~180 bytes each (when every use is of another block), so
# 512 K entries cost 90 MiB at most. Beyond the horizon a block counts as
# not used again.
HORIZON_BUDGET_ENTRIES = 1 << 19
MIN_HORIZON_ENTRIES = 4096
# Lookahead bounds, in blocks. The initial value covers 60 ms of a 500 MB/s
# link before anything is measured.
MIN_LOOKAHEAD_BLOCKS = 8
INITIAL_LOOKAHEAD_BLOCKS = 32
MAX_LOOKAHEAD_BLOCKS = 4096
MAX_BOOST = 8.0
# A read matches a planned use at most this far beyond the prefetch frontier.
MATCH_SLACK_ENTRIES = 256
TICK_S = 0.25
# A plan whose readers matched nothing for this long gives up the blocks held
# for it when another plan needs the prefetch budget (an abandoned or paused
# plan must not starve the others; it keeps them while alone).
IDLE_PLAN_S = 10.0
# Consumption covered beyond two fetch latencies: a pause of the link or of
# this process (GC, a busy CPU) must not reach the readers.
LOOKAHEAD_MARGIN_S = 0.5


class Planner:
    """Follows the active plans: matches reads to them, prefetches along them, keeps the training statistics."""

    def __init__(
        self,
        namespace: Namespace,
        cache: BlockCache,
        fetcher: Fetcher,
        held: HeldBlocks,
        active: ActivePlans,
        stats: Stats,
        *,
        budget: MemoryBudget,
        cache_dir: Path,
    ) -> None:
        self._namespace = namespace
        self._cache = cache
        self._fetcher = fetcher
        self._held = held
        self._stats = stats
        block_size = self._block_size = budget.block_size_bytes
        self._run_blocks = run_blocks(block_size)
        self._plans_dir = cache_dir / PLANS_DIR
        shutil.rmtree(self._plans_dir, ignore_errors=True)  # left over by a crash
        self._plans = active.plans  # this adds and ends them; ActivePlans answers the cache
        # Ended plans whose prefetched blocks are still held (being written): their fate still counts.
        self._ended: list[Plan] = []
        self._next_id = 1
        self.training = TrainingStats(stats)
        capacity_blocks = max(1, cache.capacity_bytes // block_size)
        self.max_lookahead_blocks = max(MIN_LOOKAHEAD_BLOCKS,
                                        min(MAX_LOOKAHEAD_BLOCKS, budget.plan_bytes // block_size))
        self.lookahead_blocks = min(INITIAL_LOOKAHEAD_BLOCKS, self.max_lookahead_blocks)
        self._horizon_entries = min(HORIZON_BUDGET_ENTRIES, max(MIN_HORIZON_ENTRIES, 4 * capacity_blocks))
        self._learned_trail = MIN_TRAIL_ENTRIES  # how far behind the head readers were seen: the next plan starts there
        self._inflight_blocks = 0  # plan prefetch's blocks in flight, and their bytes:
        self._inflight_bytes = 0  # the link is kept busy in bytes (small files are far less than a block)
        # Blocks of runs started and not finished (a run waits for a connection before its
        # blocks are in flight): another plan's `_issue` must not ask for them again.
        self._scheduled: collections.Counter[BlockKey] = collections.Counter()
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        # Measurements behind the lookahead.
        self.link = LinkEstimate(block_size, int(fetcher.prefetch_slots.total_tokens))
        self.consume_blocks_per_s = 0.0  # planned uses served
        self.fetch_bytes_per_s = 0.0  # fetched by plan prefetch
        self._tick_link_bytes = stats.fetched_bytes
        self._boost = 1.0
        self._overtaken = False
        self._tick_s = time.monotonic()
        self._tick_consumed = 0
        self._tick_fetched = 0
        self._consumed_total = 0
        self._fetched_total = 0

    # -- hooks ------------------------------------------------------------------------

    def observe(self, key: BlockKey) -> None:
        """A reader asks for a block (trio thread; cheap): the plans that expect it move on."""
        reach = self.lookahead_blocks + MATCH_SLACK_ENTRIES
        fresh = matched = False
        for plan in self._plans.values():
            heard = plan.hear(key, reach)
            if heard is None:
                continue
            fresh = True
            if heard:
                matched = True
                self._learned_trail = max(self._learned_trail, plan.min_trail)
                self._consumed_total += 1
                if plan.head > plan.issued:
                    self._overtaken = True
        if fresh:
            if not matched:
                self._stats.plan_unplanned_blocks += 1
            self._wake.set()

    def cancel_all(self, reason: str, keep_generation: str | None = None) -> None:
        """End every plan (the snapshot changed under them), except those that started
        arriving while `keep_generation` was already shown (resolved against it only)."""
        for plan in list(self._plans.values()):
            if keep_generation is not None and plan.generation == keep_generation:
                continue
            log.info("cancelling plan %d: %s", plan.id, reason)
            self._end(plan)

    # -- the background task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Prefetch along the plans and keep the statistics, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            next_tick = trio.current_time()
            while True:
                with trio.move_on_after(TICK_S):
                    await self._wake.wait()
                self._wake = trio.Event()
                if trio.current_time() >= next_tick:
                    next_tick = trio.current_time() + TICK_S
                    self._tick()
                    self._drop_passed()
                    self._reclaim_from_idle_plans()
                for plan in list(self._plans.values()):
                    try:
                        self._issue(plan)
                    except CachefsError as exc:  # its spilled entries cannot be read back
                        log.error("plan %d: %s; cancelling it", plan.id, exc)
                        self._end(plan)

    def _drop_passed(self) -> None:
        """Forget held blocks their plan moved past (or ended) without reading them: wasted."""
        self._drop_held(lambda hold: hold.plan.cancelled or hold.position < hold.plan.tail)

    def _reclaim_from_idle_plans(self) -> None:
        """When the prefetch budget is full and several plans are open, drop the blocks held for
        plans idle for IDLE_PLAN_S (wasted): the others prefetch again."""
        if len(self._plans) < 2 or self._inflight_blocks + self._held_blocks() < self.lookahead_blocks:
            return
        idle_since = time.monotonic() - IDLE_PLAN_S
        self._drop_held(lambda hold: hold.plan.progress_s < idle_since)

    def _drop_held(self, unwanted: Callable[[PlanHold], bool]) -> None:
        """Forget the held blocks `unwanted` picks (counted wasted for their plans); those on
        their way to the cache are judged once written (PlanHold.wanted)."""
        for key, held in self._held.keys_of(Owner.PLAN):
            if not held.writing and isinstance(held.note, PlanHold) and unwanted(held.note):
                self._held.drop(key)

    def _held_blocks(self) -> int:
        """Blocks' worth of memory held for the plans."""
        return -(-self._held.bytes_of(Owner.PLAN) // self._block_size)

    def _tick(self) -> None:
        """Update the rates and the lookahead; judge the hit ratio window."""
        now = time.monotonic()
        elapsed = max(1e-3, now - self._tick_s)
        consumed = (self._consumed_total - self._tick_consumed) / elapsed
        fetched = (self._fetched_total - self._tick_fetched) / elapsed
        delivered = (self._stats.fetched_bytes - self._tick_link_bytes) / elapsed  # demand fetches too
        self._tick_s, self._tick_consumed, self._tick_fetched = now, self._consumed_total, self._fetched_total
        self._tick_link_bytes = self._stats.fetched_bytes
        self.link.delivered(now, delivered)
        if self._plans:
            # Rates are averaged over ticks with consumption only: a pause (evaluation,
            # checkpoints, the gap between epochs) keeps the lookahead for the restart,
            # and a plan nobody follows never grows past its first window.
            if consumed > 0:
                self.consume_blocks_per_s = _smoothed(self.consume_blocks_per_s, consumed)
                self.fetch_bytes_per_s = _smoothed(self.fetch_bytes_per_s, fetched)
            if self._overtaken:
                self._boost = min(MAX_BOOST, self._boost * 2)
            else:
                self._boost = max(1.0, self._boost * 0.9)
            self._overtaken = False
            if self.consume_blocks_per_s > 0:
                wanted = self.consume_blocks_per_s * (2 * self.link.latency_s + LOOKAHEAD_MARGIN_S) * self._boost
                self.lookahead_blocks = max(MIN_LOOKAHEAD_BLOCKS, min(self.max_lookahead_blocks, math.ceil(wanted)))
            for plan in self._plans.values():
                self._sync_counters(plan)
        for plan in list(self._ended):
            self._sync_counters(plan)
            if not any(isinstance(held.note, PlanHold) and held.note.plan is plan
                       for _key, held in self._held.keys_of(Owner.PLAN)):
                self._ended.remove(plan)
        self.training.tick()

    def _issue(self, plan: Plan) -> None:
        """Ask for the blocks of the plan's next `lookahead_blocks` uses that are not cached or in flight."""
        if plan.cancelled:
            return
        plan.trail = max(plan.min_trail, 2 * self.lookahead_blocks)
        plan.extend_horizon(max(self._horizon_entries // max(1, len(self._plans)), MIN_HORIZON_ENTRIES,
                                plan.head - plan.tail + self.lookahead_blocks))
        target = min(plan.head + self.lookahead_blocks, plan.horizon)
        position = max(plan.issued, plan.tail)
        run: list[tuple[int, int]] = []  # (entry key, position)
        run_bytes = 0
        asked: set[int] = set()
        held_blocks = self._held_blocks()
        memory_blocks = self._inflight_blocks + held_blocks + self._readahead_blocks()
        while (position < target
               and self._inflight_bytes + run_bytes < self.link.concurrency_blocks * self._block_size
               and self._inflight_blocks + held_blocks + len(run) < self.lookahead_blocks
               and memory_blocks + len(run) < self.max_lookahead_blocks):
            entry = plan.key_at(position)
            if not plan.is_consumed(position) and entry not in asked:
                key = plan.block_key(entry)
                if key not in self._scheduled and not self._at_hand(key):
                    if run and not self._joins(plan, run, run_bytes, entry):
                        self._start_run(plan, run)  # its bytes are in _inflight_bytes from now on
                        run, run_bytes = [], 0
                    run.append((entry, position))
                    run_bytes += plan.block_length(entry)
                    asked.add(entry)
            position += 1
        if run:
            self._start_run(plan, run)
        plan.issued = position

    def _joins(self, plan: Plan, run: list[tuple[int, int]], run_bytes: int, entry: int) -> bool:
        """Whether `entry` goes into the request of `run` (`run_bytes` long): the next block of the same file, or,
        in a run of small files whole, another small file (one batch request while the hub
        takes them, up to its limit and RUN_BYTES): a sample per file needs no round trip each."""
        if plan.whole_file(run[0][0]):
            # As many files to a batch as spread the lookahead over the connections.
            slots = int(self._fetcher.prefetch_slots.total_tokens)
            batch_files = min(BATCH_MAX_FILES, -(-self.lookahead_blocks // slots))
            return (self._fetcher.batches and plan.whole_file(entry) and len(run) < batch_files
                    and run_bytes + plan.block_length(entry) <= RUN_BYTES)
        return entry == run[-1][0] + 1 and len(run) < self._run_blocks

    def _readahead_blocks(self) -> int:
        """Blocks' worth of memory read-ahead holds (other files' streams, fills, small files):
        plan prefetch leaves it out of its share of the memory budget, which bounds both together."""
        return -(-self._fetcher.readahead_memory_bytes() // self._block_size)

    def _start_run(self, plan: Plan, run: list[tuple[int, int]]) -> None:
        assert self._nursery is not None
        self._inflight_blocks += len(run)
        self._inflight_bytes += self._run_bytes(plan, run)
        self._scheduled.update(plan.block_key(entry) for entry, _position in run)
        self._nursery.start_soon(logging_failure, self._prefetch_run, plan, run)

    async def _prefetch_run(self, plan: Plan, run: list[tuple[int, int]]) -> None:
        """Fetch a run (contiguous blocks, or small files whole: one request) for `plan`, at
        read-ahead priority."""
        try:
            async with self._fetcher.prefetch_slots:
                if plan.cancelled:
                    return
                # Readers may have read or fetched some meanwhile: fetch the first stretch still
                # needed; what follows becomes runs of their own.
                def missing(item: tuple[int, int]) -> bool:
                    entry, position = item
                    return position >= plan.tail and not plan.consumed_at(position) and not self._at_hand(
                        plan.block_key(entry))

                files = plan.whole_file(run[0][0])  # small files whole: any of them in one batch
                stretches = [[item for item in run if missing(item)]] if files else list(missing_runs(run, missing))
                if not stretches or not stretches[0]:
                    return
                wanted = stretches[0]
                for stretch in stretches[1:]:
                    self._start_run(plan, stretch)
                keys = [plan.block_key(entry) for entry, _position in wanted]
                lengths = [plan.block_length(entry) for entry, _position in wanted]
                notes = [PlanHold(plan, position) for _entry, position in wanted]

                started = trio.current_time()
                if files and len(keys) > 1:
                    fetched = await self._fetcher.plan_prefetch_files(keys, lengths, notes)
                else:
                    fetched = await self._fetcher.plan_prefetch(keys, keys[0].blockno * self._block_size, lengths, notes)
                if not fetched:
                    log.debug("plan %d: prefetch of %s failed", plan.id, keys[0])
                    return
                latency_s = trio.current_time() - started
                self.link.fetched(time.monotonic(), latency_s, len(keys))
                self._fetched_total += sum(lengths)
                self._stats.plan_prefetch_blocks += len(keys)
                plan.prefetched_blocks += len(keys)
        finally:
            self._inflight_blocks -= len(run)
            self._inflight_bytes -= self._run_bytes(plan, run)
            for entry, _position in run:
                key = plan.block_key(entry)
                self._scheduled[key] -= 1
                if self._scheduled[key] <= 0:
                    del self._scheduled[key]
            self._sync_counters(plan)

    @staticmethod
    def _run_bytes(plan: Plan, run: list[tuple[int, int]]) -> int:
        return sum(plan.block_length(entry) for entry, _position in run)

    def _at_hand(self, key: BlockKey) -> bool:
        """Held in memory, in flight or cached: no prefetch needed."""
        return key in self._held or self._fetcher.in_flight_or_cached(key)

    def _sync_counters(self, plan: Plan) -> None:
        """Carry a plan's used/wasted counts into the mount's counters."""
        self._stats.plan_prefetch_used_blocks += plan.used_blocks - plan.reported_used
        self._stats.plan_prefetch_wasted_blocks += plan.wasted_blocks - plan.reported_wasted
        plan.reported_used, plan.reported_wasted = plan.used_blocks, plan.wasted_blocks

    # -- plans over the control socket ---------------------------------------------------------

    async def handle_plan(self, request: dict[str, Any], progress: Progress, lines: Lines) -> dict[str, Any]:
        """The `plan` command: receive a plan, follow it until the client closes the connection or it is done."""
        if len(self._plans) >= MAX_PLANS:
            raise CachefsError(f"too many plans at once (at most {MAX_PLANS}); close finished ones")
        epoch = request.get("epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= MAX_EPOCH):
            raise CachefsError(f"epoch must be an integer from 0 to {MAX_EPOCH}")
        plan_id = self._next_id
        self._next_id += 1
        plan = Plan(plan_id, EntryStore(self._plans_dir / f"{plan_id}.entries"), self._block_size)
        shown = self._namespace.summary()
        plan.generation = shown.generation if shown is not None else None
        plan.min_trail = plan.trail = self._learned_trail
        self._plans[plan.id] = plan
        arrival = self.training.mark()  # prefetch follows the plan while it arrives: its epoch begins here
        try:
            if not await receive_plan(plan, lines, self._namespace, self._wake.set):
                log.info("plan %d: the client went away before sending all of it", plan.id)
                return plan.summary()
            plan.mark_complete()
            plan.epoch = self.training.start_epoch(epoch, since=arrival)
            plan.advance_tail()
            log.info("plan %d (epoch %d): %d reads of %d files, %d block uses",
                     plan.id, plan.epoch, plan.reads, len(plan.files), plan.store.length)
            advised = plan.advised_block_size()
            if advised is not None:
                log.info("plan %d reads %d of every 100 bytes of the blocks it needs: --block-size %dK would fit it",
                         plan.id, 100 * plan.read_bytes // max(1, plan.use_bytes), advised >> 10)
            await progress({"state": "active", **plan.summary()})
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_when_closed, lines, nursery.cancel_scope)
                await plan.finished.wait()
                nursery.cancel_scope.cancel()
            done = plan.complete and plan.tail >= plan.store.length
            return {"state": "finished" if done else "cancelled", **plan.summary()}
        finally:
            self._end(plan)

    def _end(self, plan: Plan) -> None:
        if self._plans.pop(plan.id, None) is None:
            return
        plan.end()
        self._drop_passed()
        self._sync_counters(plan)
        self._ended.append(plan)
        log.info("plan %d ended: %d blocks prefetched, %d used, %d wasted",
                 plan.id, plan.prefetched_blocks, plan.used_blocks, plan.wasted_blocks)

    # -- reporting ----------------------------------------------------------------------------

    def snapshot(self, judge: bool = True) -> dict[str, Any]:
        """Plans, lookahead, link estimates, epochs. Only the trio thread may `judge` (tick the statistics)."""
        if judge:
            self.training.tick()  # judge the reads since the last tick, if there are enough
        plans = list(self._plans.values())  # a copy: the metrics thread reads this too
        return {
            "plans_active": len(plans),
            "plans": [plan.summary() for plan in plans],
            "lookahead_blocks": self.lookahead_blocks,
            "max_lookahead_blocks": self.max_lookahead_blocks,
            "prefetch_latency_s": self.link.latency_s,
            "prefetch_concurrency_blocks": self.link.concurrency_blocks,
            "link_rtt_s": self.link.rtt_s,
            "link_rate_bytes_per_s": self.link.bytes_per_s,
            "consume_rate_blocks_per_s": self.consume_blocks_per_s,
            "prefetch_rate_bytes_per_s": self.fetch_bytes_per_s,
            **self.training.snapshot(),
        }


def _smoothed(average: float, sample: float) -> float:
    """A rate average moved towards the newest tick's sample (the first sample sets it)."""
    return average + (RATE_SMOOTHING if average else 1.0) * (sample - average)
