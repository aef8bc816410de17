"""A PNG of the cold-to-warm loader run over time (needs matplotlib: `pip install 'cachefs[bench]'`).

Four panels sharing the time axis: loader throughput, cache hit ratio, read
latency, accelerator busy %. The cachefs run is drawn in full; peers and the
local disk are drawn as thinner lines in the throughput and busy panels.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _timeline(scenario: dict[str, Any]) -> list[dict[str, Any]]:
    loader = scenario.get("results", {}).get("workloads", {}).get("loader", {})
    return loader.get("timeline", []) if "skipped" not in loader else []


def _series(points: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(point["t_s"], point[key]) for point in points if point.get(key) is not None]
    return [pair[0] for pair in pairs], [pair[1] for pair in pairs]


def _epoch_starts(points: Sequence[dict[str, Any]]) -> list[float]:
    """Times at which a later epoch began."""
    starts, previous = [], None
    for point in points:
        if previous is not None and point["epoch"] != previous:
            starts.append(point["t_s"])
        previous = point["epoch"]
    return starts


def plot_loader(main: dict[str, Any], others: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Draw `main`'s loader timeline (others for comparison) into `path`; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'cachefs[bench]'): no plot")
        return None
    points = _timeline(main)
    if not points:
        log.warning("no loader timeline in %s: no plot", main.get("name"))
        return None
    figure, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    throughput, hits, latency, busy = axes
    throughput.plot(*_series(points, "samples_per_s"), label=main["name"], color="C0", linewidth=1.8)
    busy.plot(*_series(points, "busy_pct"), label=main["name"], color="C0", linewidth=1.8)
    for index, other in enumerate(others, start=1):
        other_points = _timeline(other)
        if other_points:
            throughput.plot(*_series(other_points, "samples_per_s"), label=other["name"], color=f"C{index}",
                            linewidth=0.9, alpha=0.8)
            busy.plot(*_series(other_points, "busy_pct"), label=other["name"], color=f"C{index}", linewidth=0.9,
                      alpha=0.8)
    hits.plot(*_series(points, "hit_ratio_pct"), color="C0", label="block hit ratio")
    latency.plot(*_series(points, "read_p50_ms"), color="C0", label="p50")
    latency.plot(*_series(points, "read_p99_ms"), color="C3", label="p99")
    latency.set_yscale("log")
    throughput.set_ylabel("samples/s")
    hits.set_ylabel("hit ratio %")
    hits.set_ylim(-5, 105)
    latency.set_ylabel("16 KiB read ms")
    busy.set_ylabel("accelerator busy %")
    busy.set_ylim(-5, 105)
    busy.set_xlabel("seconds since the loader started (epoch 1 cold, epoch 2 warm)")
    for axis in axes:
        for start in _epoch_starts(points):
            axis.axvline(start, color="grey", linestyle="--", linewidth=0.8)
        axis.grid(True, alpha=0.3)
        axis.legend(loc="best", fontsize=7)
    figure.suptitle(f"Training-like loader, cold to warm: {main['name']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
