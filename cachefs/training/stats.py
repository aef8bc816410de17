"""Training-facing numbers: per-epoch hit ratio, stall seconds and bytes fetched, and time to warm.

Epochs are what loaders say they are: a plan (planner.py) carries its
epoch number, and the first plan of a new epoch closes the record of the
previous one. Each record holds the differences of the mount's counters
(metrics.Stats) over the epoch, which begins when that plan began to arrive
(prefetch follows a plan while it is received).

*Time to warm* is the time from the first block read (of the mount, or of
an epoch) until the hit ratio went above `WARM_HIT_RATIO` and stayed there.
It is judged over windows of at least `MIN_WINDOW_BLOCKS` block reads, so a
handful of reads never decides it; a later window below the mark makes the
cache cold again until the ratio recovers.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..metrics import Stats

WARM_HIT_RATIO = 0.95
MIN_WINDOW_BLOCKS = 64
# A window with fewer block reads is judged after this long anyway (slow readers).
MAX_WINDOW_S = 10.0
EPOCHS_KEPT = 100
_COUNTERS = (
    "reads", "read_bytes", "block_hits", "block_misses", "stall_seconds", "stalled_blocks", "fetched_bytes",
    "plan_prefetch_blocks", "plan_prefetch_used_blocks", "plan_prefetch_wasted_blocks",
)


class WarmTracker:
    """Since when the hit ratio has stayed at or above WARM_HIT_RATIO."""

    def __init__(self, reference_s: float | None = None) -> None:
        self.reference_s = reference_s  # None: the start of the first window with reads
        self.warm_since_s: float | None = None

    def window(self, start_s: float, hits: int, misses: int) -> None:
        if self.reference_s is None:
            self.reference_s = start_s
        if hits / (hits + misses) >= WARM_HIT_RATIO:
            if self.warm_since_s is None:
                self.warm_since_s = start_s
        else:
            self.warm_since_s = None

    def time_to_warm_s(self) -> float | None:
        if self.warm_since_s is None or self.reference_s is None:
            return None
        return max(0.0, self.warm_since_s - self.reference_s)


@dataclasses.dataclass(frozen=True)
class Mark:
    """The clocks and the mount's counters at one moment: where an epoch may be said to begin."""

    monotonic_s: float
    unix: float
    counters: dict[str, float]


@dataclasses.dataclass
class EpochRecord:
    epoch: int
    started_s: float  # monotonic
    started_unix: float
    start: dict[str, float]
    warm: WarmTracker
    ended_s: float | None = None
    end: dict[str, float] | None = None

    def as_dict(self, now_s: float, current: dict[str, float]) -> dict[str, Any]:
        end = self.end if self.end is not None else current
        delta = {name: end[name] - self.start[name] for name in _COUNTERS}
        looked_up = delta["block_hits"] + delta["block_misses"]
        return {
            "epoch": self.epoch,
            "started_unix": self.started_unix,
            "duration_s": (self.ended_s if self.ended_s is not None else now_s) - self.started_s,
            "current": self.end is None,
            "hit_ratio": delta["block_hits"] / looked_up if looked_up else None,
            "time_to_warm_s": self.warm.time_to_warm_s(),
            **{name: int(value) if name != "stall_seconds" else value for name, value in delta.items()},
        }


class TrainingStats:
    """Per-epoch records and time to warm, from the mount's counters; `tick` it every fraction of a second."""

    def __init__(self, stats: Stats, clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._clock = clock
        self.mount_warm = WarmTracker()
        self.epochs: collections.deque[EpochRecord] = collections.deque(maxlen=EPOCHS_KEPT)
        self._window_start_s = clock()
        self._window = self._counters()

    def _counters(self) -> dict[str, float]:
        return {name: getattr(self._stats, name) for name in _COUNTERS}

    @property
    def current_epoch(self) -> int | None:
        return self.epochs[-1].epoch if self.epochs and self.epochs[-1].end is None else None

    def mark(self) -> Mark:
        return Mark(self._clock(), time.time(), self._counters())

    def start_epoch(self, epoch: int | None, since: Mark | None = None) -> int:
        """Make `epoch` (None: the one after the last) the current epoch, begun at `since` (a mark
        taken as its plan began to arrive; now if None or older than the current epoch); returns its number."""
        if epoch is None:
            epoch = self.epochs[-1].epoch + 1 if self.epochs else 1
        if epoch == self.current_epoch:
            return epoch
        self.tick(force=True)
        if since is None or (self.epochs and since.monotonic_s < self.epochs[-1].started_s):
            since = self.mark()
        # The reads just judged end the last epoch; the next window is the new epoch's first,
        # and starts with it: an epoch whose reads all hit is warm at 0 s, not a moment later.
        self._window_start_s = min(self._window_start_s, since.monotonic_s)
        if self.epochs and self.epochs[-1].end is None:
            self.epochs[-1].end, self.epochs[-1].ended_s = since.counters, since.monotonic_s
        self.epochs.append(EpochRecord(epoch, since.monotonic_s, since.unix, since.counters, WarmTracker(since.monotonic_s)))
        return epoch

    def tick(self, force: bool = False) -> None:
        """Judge the window of reads since the last judgement, once it is big or old enough."""
        now = self._clock()
        counters = self._counters()
        hits = int(counters["block_hits"] - self._window["block_hits"])
        misses = int(counters["block_misses"] - self._window["block_misses"])
        old = now - self._window_start_s >= MAX_WINDOW_S
        # At an epoch's start (force) a smaller window is judged, but not a handful of
        # reads: those are carried over into the new epoch's first window.
        enough = MIN_WINDOW_BLOCKS // 4 if force else MIN_WINDOW_BLOCKS
        if hits + misses >= enough or (hits + misses > 0 and old):
            self.mount_warm.window(self._window_start_s, hits, misses)
            if self.epochs and self.epochs[-1].end is None:
                self.epochs[-1].warm.window(self._window_start_s, hits, misses)
        elif not old:
            return
        self._window_start_s, self._window = now, counters

    def snapshot(self) -> dict[str, Any]:
        now, counters = self._clock(), self._counters()
        return {
            "time_to_warm_s": self.mount_warm.time_to_warm_s(),
            "warm": self.mount_warm.warm_since_s is not None,
            "epochs": [record.as_dict(now, counters) for record in list(self.epochs)],
        }
