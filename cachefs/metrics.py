"""Every counter and metric of the spoke: `cachefs stats` and Prometheus (`cachefs_` prefix).

Counters live in one `Stats` object, updated with plain `+=` from the trio
thread and worker threads (fine for statistics); a collector turns them into
Prometheus metrics at scrape time, so there is one source for both views.
Latencies are Prometheus histograms. No label ever holds a path. Beside them:
the standard `process_*` (memory, CPU, file descriptors) and `python_info`.
"""

from __future__ import annotations

import collections
import dataclasses
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# A *_created series per counter and histogram doubles the series a scrape
# stores and no rule or panel uses them (a process-wide setting of the client).
disable_created_metrics()

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Reads served from page-cache-cold local NVMe take ~0.1-1 ms, hub fetches at
# 60 ms RTT 60-200 ms: buckets cover both with room for stalls.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
READ_DURATION = Histogram(
    "cachefs_read_duration_seconds", "Time to answer one FUSE read", buckets=_LATENCY_BUCKETS, registry=REGISTRY
)
FETCH_DURATION = Histogram(
    "cachefs_fetch_duration_seconds", "Time of one successful ranged request to the hub",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
STALL_DURATION = Histogram(
    "cachefs_read_stall_seconds",
    "Time a read waited on the network for one block (its own fetch or one under way); local hits are not observed",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)


def process_usage() -> dict[str, float | int | None]:
    """The daemon's CPU seconds, its event loop's share (trio runs on the main thread), and its peak RSS.

    `cachefs bench` takes these before and after each workload: CPU per phase, not per mount.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    main = threading.main_thread().ident
    loop_s = time.clock_gettime(time.pthread_getcpuclockid(main)) if main is not None else None
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "loop_cpu_s": loop_s, "peak_rss_kib": usage.ru_maxrss}


@dataclasses.dataclass
class Stats:
    """Counters since mount."""

    reads: int = 0
    read_bytes: int = 0
    block_hits: int = 0  # blocks served from the local cache (disk or memory) or a fetch already under way
    block_misses: int = 0  # blocks a reader had to ask the hub for
    stall_seconds: float = 0.0  # time readers waited on the hub (their own fetches and fetches under way)
    stalled_blocks: int = 0  # block reads that waited on the network
    fetches: int = 0  # ranged requests answered by the hub (demand + read-ahead + warm)
    fetched_bytes: int = 0  # bytes received from the hub: the WAN cost
    readahead_fetches: int = 0  # blocks asked for by read-ahead
    readahead_used: int = 0  # of those, blocks a reader later read
    fetch_retries: int = 0
    fetch_failures: int = 0  # fetches given up (the read failed)
    corrupt_blocks: int = 0  # cached blocks that failed their checksum
    disk_reads: int = 0  # reads of cached bytes not in the page cache (the cache's disk)
    disk_reads_inline: int = 0  # of those, small reads done on the event loop's thread (read/blocks.py)
    integrity_failures: int = 0  # hub responses that failed their checksum
    store_errors: int = 0
    evicted_blocks: int = 0
    rejected_blocks: int = 0  # fetched but not admitted to a full cache (less popular than what it holds)
    plan_prefetch_blocks: int = 0  # blocks fetched ahead of readers along a loader's plan (training/planner.py)
    plan_prefetch_used_blocks: int = 0  # of those, blocks read while the plan still expected them
    plan_prefetch_wasted_blocks: int = 0  # of those, blocks not read before the plan moved past them or ended
    plan_unplanned_blocks: int = 0  # block reads that matched no active plan while one was active
    passthrough_opens: int = 0  # opens of whole verified cached files the kernel reads directly (fs/passthrough.py)
    verified_files: int = 0  # cached files read back whole and verified, so they can be opened that way
    reverified_files: int = 0  # verified files re-hashed whole on the period (fs/reverify.py)
    reverify_failures: int = 0  # of those, files whose data file had changed on disk (taken back from the kernel)
    hub_errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    fuse_errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # With a regional tier (fetch/tier_client.py), by node position in --tier or "hub":
    tier_requests: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # answered
    tier_failovers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # failed, asked the next

    def as_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        for field in ("hub_errors", "fuse_errors", "tier_requests", "tier_failovers"):
            values[field] = dict(getattr(self, field))
        return values


_COUNTERS = {  # Stats field -> (metric name without _total, help)
    "reads": ("cachefs_reads", "FUSE reads answered"),
    "read_bytes": ("cachefs_read_bytes", "Bytes returned to readers"),
    "block_hits": ("cachefs_block_hits", "Blocks served locally"),
    "block_misses": ("cachefs_block_misses", "Blocks readers had to wait for the hub for"),
    "stall_seconds": ("cachefs_stall_seconds", "Time readers waited on the hub"),
    "stalled_blocks": ("cachefs_stalled_blocks", "Block reads that waited on the network"),
    "fetches": ("cachefs_fetches", "Ranged requests answered by the hub"),
    "fetched_bytes": ("cachefs_fetched_bytes", "Bytes received from the hub (WAN cost)"),
    "readahead_fetches": ("cachefs_prefetch_blocks", "Blocks requested ahead of readers"),
    "readahead_used": ("cachefs_prefetch_used_blocks", "Prefetched blocks later read"),
    "fetch_retries": ("cachefs_fetch_retries", "Hub requests retried"),
    "fetch_failures": ("cachefs_fetch_failures", "Fetches given up after retries"),
    "corrupt_blocks": ("cachefs_corrupt_blocks", "Cached blocks that failed their checksum"),
    "disk_reads": ("cachefs_disk_reads", "Reads of cached bytes that were not in the page cache"),
    "disk_reads_inline": ("cachefs_disk_reads_inline", "Small disk reads done without a worker thread"),
    "integrity_failures": ("cachefs_integrity_failures", "Hub responses that failed their checksum"),
    "store_errors": ("cachefs_store_errors", "Writes to the cache that failed (blocks, verification commits)"),
    "evicted_blocks": ("cachefs_evicted_blocks", "Blocks evicted"),
    "rejected_blocks": ("cachefs_rejected_blocks", "Blocks not admitted to a full cache"),
    "plan_prefetch_blocks": ("cachefs_plan_prefetch_blocks", "Blocks fetched ahead of readers along a plan"),
    "plan_prefetch_used_blocks": ("cachefs_plan_prefetch_used_blocks", "Plan-prefetched blocks read as planned"),
    "plan_prefetch_wasted_blocks": ("cachefs_plan_prefetch_wasted_blocks", "Plan-prefetched blocks never read"),
    "plan_unplanned_blocks": ("cachefs_plan_unplanned_blocks", "Block reads no active plan expected"),
    "passthrough_opens": ("cachefs_passthrough_opens", "Opens of whole verified cached files read by the kernel directly"),
    "verified_files": ("cachefs_verified_files", "Cached files verified whole, so the kernel may read them directly"),
    "reverified_files": ("cachefs_reverified_files", "Verified cached files re-hashed whole on the re-verification period"),
    "reverify_failures": ("cachefs_reverify_failures", "Verified cached files whose data file changed on disk"),
}


# Label values of the labelled counters exported at zero before the first
# error, so that increase() and rate() see that error (a series born at 1 has
# no earlier sample to count from). Kinds are set in fetch/verified.py.
UPSTREAM_ERROR_KINDS = ("timeout", "connection", "protocol", "changed", "http_4xx", "http_5xx")
WATCHED_FUSE_OPERATIONS = ("open", "read")  # the ones a failed read of a file fails in

_GAUGES = {  # name -> help
    "cachefs_cache_used_bytes": "Bytes of blocks in the cache",
    "cachefs_cache_capacity_bytes": "Size limit of the cache (--cache-size)",
    "cachefs_cache_pinned_bytes": "Bytes of pinned blocks, which are never evicted",
    "cachefs_cache_blocks": "Blocks in the cache",
    "cachefs_fetches_in_flight": "Requests to the hub under way",
    "cachefs_write_queue_bytes": "Fetched bytes queued for the cache writer or being written",
    "cachefs_write_waiting_fetches": "Fetches holding fetched bytes while they wait for the cache writer's room",
    "cachefs_block_buffer_bytes": "Block-sized buffers in use (slots of the block buffer pool)",
    "cachefs_block_buffer_resident_bytes": "Memory of the block buffer pool's slots filled since their last trim",
    "cachefs_plans_active": "Loader plans being followed",
    "cachefs_plan_lookahead_blocks": "Blocks fetched ahead of the readers along the plans",
    "cachefs_time_to_warm_seconds": "Time from the first read until the hit ratio stayed at 95 % or more (-1: not warm yet)",
    "cachefs_epoch": "The current epoch of the training job",
    "cachefs_epoch_hit_ratio": "Share of the current epoch's block reads served locally",
    "cachefs_epoch_stall_seconds": "Time readers waited on the hub in the current epoch",
    "cachefs_epoch_fetched_bytes": "Bytes fetched from the hub in the current epoch",
}


def cache_gauges(
    *, used_bytes: int, capacity_bytes: int, pinned_bytes: int, blocks: int, fetches_in_flight: int,
    write_backlog: tuple[int, int], block_buffers: tuple[int, int],
) -> dict[str, float]:
    """Gauges of the block cache and the fetcher (`write_backlog`: Fetcher.write_backlog;
    `block_buffers`: BlockBuffers.in_use_bytes and resident_bytes)."""
    queued_bytes, waiting_fetches = write_backlog
    buffer_bytes, buffer_resident_bytes = block_buffers
    return {
        "cachefs_cache_used_bytes": used_bytes,
        "cachefs_cache_capacity_bytes": capacity_bytes,
        "cachefs_cache_pinned_bytes": pinned_bytes,
        "cachefs_cache_blocks": blocks,
        "cachefs_fetches_in_flight": fetches_in_flight,
        "cachefs_write_queue_bytes": queued_bytes,
        "cachefs_write_waiting_fetches": waiting_fetches,
        "cachefs_block_buffer_bytes": buffer_bytes,
        "cachefs_block_buffer_resident_bytes": buffer_resident_bytes,
    }


def training_gauges(training: dict[str, Any]) -> dict[str, float]:
    """Gauges from the planner's snapshot (planner.Planner.snapshot): plans, lookahead, the current epoch."""
    gauges = {
        "cachefs_plans_active": training["plans_active"],
        "cachefs_plan_lookahead_blocks": training["lookahead_blocks"],
        "cachefs_time_to_warm_seconds": training["time_to_warm_s"] if training["time_to_warm_s"] is not None else -1,
    }
    epochs = training["epochs"]
    if epochs:
        current = epochs[-1]
        gauges["cachefs_epoch"] = current["epoch"]
        gauges["cachefs_epoch_hit_ratio"] = current["hit_ratio"] if current["hit_ratio"] is not None else 0.0
        gauges["cachefs_epoch_stall_seconds"] = current["stall_seconds"]
        gauges["cachefs_epoch_fetched_bytes"] = current["fetched_bytes"]
    return gauges


# Per tenant of the cache dir (cache/tenants.py), label `tenant`: every tenant
# that published a record, as it published it (a mount's counters restart at 0).
_TENANT_GAUGES = {  # record field -> (name, help)
    "used_bytes": ("cachefs_tenant_used_bytes", "Bytes of blocks the tenant holds in the shared cache dir"),
    "pinned_bytes": ("cachefs_tenant_pinned_bytes", "Bytes of the files the tenant pinned in the shared cache dir"),
    "allowance_bytes": ("cachefs_tenant_allowance_bytes", "Bytes the sharing policy allows the tenant now"),
    "min_bytes": ("cachefs_tenant_min_bytes", "Bytes guaranteed to the tenant while mounted (--cache-min)"),
    "max_bytes": ("cachefs_tenant_max_bytes", "The tenant's cap (--cache-max)"),
    "live": ("cachefs_tenant_mounted", "1 if the tenant's daemon is running"),
}
_TENANT_COUNTERS = {
    "block_hits": ("cachefs_tenant_block_hits", "Blocks the tenant's readers found locally, since its mount"),
    "block_misses": ("cachefs_tenant_block_misses", "Blocks the tenant's readers waited for the hub for, since its mount"),
    "fetched_bytes": ("cachefs_tenant_fetched_bytes", "Bytes the tenant received from its hub, since its mount"),
}


class SpokeCollector(Collector):
    """Exposes `Stats` and the cache's gauges at scrape time."""

    def __init__(
        self,
        stats: Stats,
        gauges: Callable[[], dict[str, float]],
        tenants: Callable[[], list[dict[str, Any]]] | None = None,
        held: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """`held`: block bytes held in memory per owner (HeldBlocks.bytes_by_owner)."""
        self._stats = stats
        self._gauges = gauges
        self._tenants = tenants
        self._held = held

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for field, (name, text) in _COUNTERS.items():
            yield CounterMetricFamily(name, text, value=getattr(self._stats, field))
        yield _labelled(
            name="cachefs_upstream_errors", text="Failed requests to the hub (or the regional cache in front of it), by kind",
            label="kind", counts=self._stats.hub_errors, known=UPSTREAM_ERROR_KINDS,
        )
        yield _labelled(
            name="cachefs_fuse_errors", text="FUSE requests answered with an error, by operation",
            label="operation", counts=self._stats.fuse_errors, known=WATCHED_FUSE_OPERATIONS,
        )
        if self._stats.tier_requests:  # only spokes with a --tier (tier_client.py sets its labels)
            yield _labelled(
                name="cachefs_tier_requests", text="Requests for file data answered, by tier node (its --tier position) or hub",
                label="node", counts=self._stats.tier_requests, known=(),
            )
            yield _labelled(
                name="cachefs_tier_failovers", text="Requests a tier node failed, asked of the next node or the hub, by node",
                label="node", counts=self._stats.tier_failovers, known=(),
            )
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(name, _GAUGES[name], value=value)
        if self._held is not None:
            held = GaugeMetricFamily("cachefs_held_block_bytes", "Block bytes the daemon holds in memory, by owner",
                                     labels=["owner"])
            for owner, size in self._held().items():
                held.add_metric([owner], size)
            yield held
        if self._tenants is not None:
            yield from _tenant_metrics(self._tenants())


def _tenant_metrics(tenants: list[dict[str, Any]]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    for field, (name, text) in _TENANT_GAUGES.items():
        gauge = GaugeMetricFamily(name, text, labels=["tenant"])
        for tenant in tenants:
            gauge.add_metric([tenant["name"]], float(tenant[field]))
        yield gauge
    for field, (name, text) in _TENANT_COUNTERS.items():
        counter = CounterMetricFamily(name, text, labels=["tenant"])
        for tenant in tenants:
            counter.add_metric([tenant["name"]], tenant[field])
        yield counter


def _labelled(
    *, name: str, text: str, label: str, counts: collections.Counter[str], known: tuple[str, ...]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=[label])
    for value in sorted(set(known) | set(counts)):
        family.add_metric([value], counts[value])
    return family


def serve_metrics(
    listen: tuple[str, int],
    stats: Stats,
    gauges: Callable[[], dict[str, float]],
    tenants: Callable[[], list[dict[str, Any]]] | None = None,
    held: Callable[[], dict[str, int]] | None = None,
) -> None:
    """Start the /metrics HTTP endpoint (a daemon thread of prometheus-client)."""
    REGISTRY.register(SpokeCollector(stats, gauges, tenants, held))
    start_http_server(listen[1], addr=listen[0], registry=REGISTRY)
