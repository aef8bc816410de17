"""Epoch records (training/stats.py) on the mount's real counters and a fake clock."""

from __future__ import annotations

from cachefs.metrics import Stats
from cachefs.training.stats import TrainingStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_epoch_begins_when_its_plan_began_to_arrive() -> None:
    """Prefetch follows a plan while it is received: what it fetches then is the new epoch's."""
    stats, clock = Stats(), Clock()
    training = TrainingStats(stats, clock)
    training.start_epoch(1)
    stats.fetched_bytes += 100
    clock.now += 5
    arrival = training.mark()
    stats.fetched_bytes += 30  # the next plan's first prefetch, before that plan is whole
    clock.now += 1
    training.start_epoch(2, since=arrival)
    stats.fetched_bytes += 20
    first, second = training.snapshot()["epochs"]
    assert (first["fetched_bytes"], first["duration_s"]) == (100, 5.0)
    assert (second["fetched_bytes"], second["current"]) == (50, True)


def test_a_mark_older_than_the_current_epoch_starts_the_next_one_now() -> None:
    stats, clock = Stats(), Clock()
    training = TrainingStats(stats, clock)
    early = training.mark()
    clock.now += 1
    training.start_epoch(1)
    stats.fetched_bytes += 100
    training.start_epoch(2, since=early)  # that plan began to arrive before epoch 1 did
    first, second = training.snapshot()["epochs"]
    assert first["fetched_bytes"] == 100 and second["fetched_bytes"] == 0


def test_an_epoch_whose_reads_all_hit_is_warm_at_its_start() -> None:
    """The last epoch's leftover reads are judged as the next one begins; the next epoch's
    first window then starts with it, not at the moment its start was processed."""
    stats, clock = Stats(), Clock()
    training = TrainingStats(stats, clock)
    training.start_epoch(1)
    stats.block_misses += 100
    training.tick()
    stats.block_misses += 20  # enough to be judged when epoch 2 begins
    arrival = training.mark()
    clock.now += 0.001
    training.start_epoch(2, since=arrival)
    stats.block_hits += 64
    clock.now += 1
    training.tick()
    first, second = training.snapshot()["epochs"]
    assert first["time_to_warm_s"] is None
    assert second["time_to_warm_s"] == 0.0
