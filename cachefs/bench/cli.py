"""`cachefs bench PATH`: read workloads against any mounted directory.

    cachefs bench /mnt/c4 --quick --json results.json
    cachefs bench /mnt/c4 --workloads seq1,loader --loader-compute-ms 100

PATH may be a cachefs mount (then its counters are sampled into the loader
timeline), a local directory, or any other filesystem. Prints a Markdown
table on stdout; `--json` writes every number, the loader timeline included.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from ..cli.commands import OneLineParser
from . import report
from .loader import LoaderConfig, run_loader
from .memory import PhasePeaks
from .workloads import (
    Dataset,
    can_drop_page_cache,
    drop_page_cache,
    find_dataset,
    machine_cpu_seconds,
    random_pread,
    sequential_read,
    small_read_all,
    tree_walk,
)

log = logging.getLogger(__name__)

WORKLOADS = ("seq1", "seq4", "rand4k", "rand16k", "walk", "small", "loader")
STATS_XATTR = "user.cachefs.stats"


@dataclasses.dataclass(frozen=True)
class Budget:
    """Count and time bounds of one run; `--quick` picks the small one."""

    time_limit_s: float  # per sequential, walk and small-file workload
    random_reads: int
    random_time_limit_s: float
    loader_samples: int
    loader_epoch_time_limit_s: float


QUICK = Budget(time_limit_s=60, random_reads=1000, random_time_limit_s=6, loader_samples=2048,
               loader_epoch_time_limit_s=60)
FULL = Budget(time_limit_s=120, random_reads=5000, random_time_limit_s=15, loader_samples=8192,
              loader_epoch_time_limit_s=120)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _milliseconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="cachefs bench",
        description="Measure read workloads on a directory: sequential throughput, random pread latency, "
        "small-file walk and read, and a training-like loader. Large files are shards/*.bin "
        "(if none, files >= 8 MiB), small files small/*/* (else the rest). Exits 1 if reads failed.",
    )
    parser.add_argument("path", type=Path, help="the directory to read (a mount or a local dir)")
    parser.add_argument("--quick", action="store_true", help="smaller count and time budgets")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write all results as JSON to FILE")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--label", help="name of this run in the report (default: PATH)")
    parser.add_argument("--time-limit", type=_seconds, metavar="SECONDS", help="bound per workload")
    parser.add_argument("--random-reads", type=_positive_int, metavar="N", help="preads per random workload")
    parser.add_argument("--rand4k-reads", type=_positive_int, metavar="N", help="preads of the 4 KiB workload (overrides)")
    parser.add_argument("--rand16k-reads", type=_positive_int, metavar="N", help="preads of the 16 KiB workload (overrides)")
    parser.add_argument("--small-files", type=_positive_int, metavar="N", help="read at most N small files (default: all)")
    parser.add_argument("--small-threads", type=_positive_int, default=16, help="threads reading small files (default: 16)")
    parser.add_argument("--loader-workers", type=_positive_int, default=LoaderConfig.workers,
                        help="loader processes (default: %(default)s)")
    parser.add_argument("--loader-batch", type=_positive_int, default=LoaderConfig.batch_size,
                        help="samples per batch (default: %(default)s)")
    parser.add_argument("--loader-compute-ms", type=_milliseconds, default=LoaderConfig.compute_s * 1000,
                        help="emulated accelerator time per batch (default: %(default)g)")
    parser.add_argument("--loader-samples", type=_count, metavar="N", help="samples per epoch (0: all)")
    parser.add_argument("--loader-epochs", type=_positive_int, default=LoaderConfig.epochs, help="epochs (default: 2)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the kernel's page cache before each workload (root only): each reads the "
                             "files as on a node that listed them but has not read them since boot")
    parser.add_argument("--seed", type=int, default=0, help="seed of offsets and shuffles (default: 0)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    return parser


def mount_stats(path: Path) -> dict[str, Any] | None:
    """A cachefs mount's counters, or None for any other directory."""
    try:
        return json.loads(os.getxattr(path, STATS_XATTR))
    except (OSError, ValueError):
        return None


def daemon_usage(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a cachefs daemon spent between two of its stats: CPU seconds (and its event loop's) and
    bytes fetched from the hub; None for any other filesystem."""
    if not before or not after or "process" not in before or "process" not in after:
        return None
    start, end = before["process"], after["process"]
    loop_s = end["loop_cpu_s"] - start["loop_cpu_s"] if None not in (start["loop_cpu_s"], end["loop_cpu_s"]) else None
    return {"cpu_s": end["cpu_s"] - start["cpu_s"], "loop_cpu_s": loop_s,
            "fetched_bytes": after["fetched_bytes"] - before["fetched_bytes"]}


def readers_cpu_seconds() -> float:
    """CPU seconds this process and its reaped children (the loader's workers) have used: the
    readers' side of a workload, in user and kernel mode."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _selected(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    return names


def _loader_config(args: argparse.Namespace, budget: Budget) -> LoaderConfig:
    return LoaderConfig(
        workers=args.loader_workers,
        batch_size=args.loader_batch,
        compute_s=args.loader_compute_ms / 1000,
        samples_per_epoch=budget.loader_samples if args.loader_samples is None else args.loader_samples,
        epochs=args.loader_epochs,
        epoch_time_limit_s=budget.loader_epoch_time_limit_s,
        seed=args.seed,
    )


def run_workload(name: str, dataset: Dataset, args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Run one named workload and return its result as a dict."""
    time_limit_s = args.time_limit or budget.time_limit_s
    random_limit_s = args.time_limit or budget.random_time_limit_s
    reads = args.random_reads or budget.random_reads
    if name == "seq1":
        return sequential_read(dataset.large_group("seq1"), 1, time_limit_s).as_dict()
    if name == "seq4":
        return sequential_read(dataset.large_group("seq4"), 4, time_limit_s).as_dict()
    if name == "rand4k":
        count = args.rand4k_reads or reads
        return random_pread(dataset.large_group("random"), 4096, count, random_limit_s, args.seed).as_dict()
    if name == "rand16k":
        count = args.rand16k_reads or reads
        return random_pread(dataset.large_group("random"), 16384, count, random_limit_s, args.seed + 1).as_dict()
    if name == "walk":
        return tree_walk(dataset.small_root, time_limit_s).as_dict()
    if name == "small":
        return small_read_all(dataset.small, args.small_threads, time_limit_s, args.small_files).as_dict()
    if name == "loader":
        stats_fn = (lambda: mount_stats(args.path)) if mount_stats(args.path) is not None else None
        return run_loader(dataset.large_group("loader"), _loader_config(args, budget), stats_fn).as_dict()
    raise ValueError(name)


def _can_run(name: str, dataset: Dataset) -> str | None:
    """Why `name` cannot run on this dataset, or None."""
    if name in ("seq1", "seq4", "rand4k", "rand16k", "loader") and not dataset.large:
        return "no large files"
    if name == "small" and not dataset.small:
        return "no small files"
    return None


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every selected workload on args.path, in order, as one JSON-able dict."""
    budget = QUICK if args.quick else FULL
    dataset = find_dataset(args.path)
    results: dict[str, Any] = {
        "label": args.label or str(args.path),
        "path": str(args.path),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "budget": dataclasses.asdict(budget),
        "dataset": {
            "large_files": len(dataset.large),
            "large_bytes": sum(entry.size_bytes for entry in dataset.large),
            "small_files": len(dataset.small),
            "small_bytes": sum(entry.size_bytes for entry in dataset.small),
        },
        "stats_before": mount_stats(args.path),
        "workloads": {},
    }
    stats = results["stats_before"]  # the counters as the next workload starts: the last one's end
    peaks = PhasePeaks.of_mount(stats)
    for name in _selected(args.workloads):
        reason = _can_run(name, dataset)
        if reason:
            results["workloads"][name] = {"skipped": reason}
            continue
        if args.drop_caches:
            drop_page_cache(names_too=False)  # the dataset's listing above stays, as a training job's would
        log.info("%s: running %s", args.path, name)
        began = time.monotonic()
        if peaks:
            peaks.start()
        readers_before, machine_before = readers_cpu_seconds(), machine_cpu_seconds()
        result = run_workload(name, dataset, args, budget)
        result["readers_cpu_s"] = readers_cpu_seconds() - readers_before
        if machine_before and (machine_after := machine_cpu_seconds()):
            result["machine_cpu"] = {"busy_s": machine_after[0] - machine_before[0],
                                     "idle_s": machine_after[1] - machine_before[1]}
        after = mount_stats(args.path)
        if usage := daemon_usage(stats, after):
            result["daemon"] = usage
            if peaks:
                usage["peak_rss_kib"] = peaks.end()
        stats = after
        results["workloads"][name] = result
        log.info("%s: %s done in %.1f s", args.path, name, time.monotonic() - began)
    results["stats_after"] = stats
    results["daemon_peak_rss_kib"] = peaks.highest if peaks else None
    return results


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.path.is_dir():
        print(f"cachefs bench: error: {args.path} is not a directory", file=sys.stderr)
        return 2
    try:
        _selected(args.workloads)
    except ValueError as exc:
        print(f"cachefs bench: error: {exc}", file=sys.stderr)
        return 2
    if args.drop_caches and not can_drop_page_cache():
        print("cachefs bench: error: --drop-caches needs root (it writes /proc/sys/vm/drop_caches)", file=sys.stderr)
        return 2
    if args.json:  # found out before the run, not after it
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "a"):
                pass
        except OSError as exc:
            print(f"cachefs bench: error: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    results = run_all(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(report.single_run_table(results))
    failed = _failed_reads(results["workloads"])
    if failed:
        print(f"cachefs bench: error: {failed} reads failed (marked !; the log lines above say which)", file=sys.stderr)
        return 1
    return 0


def _failed_reads(result: Any) -> int:
    """Every workload's failed reads (their `errors`, also the loader's per epoch)."""
    if isinstance(result, dict):
        own = result.get("errors")
        return (own if isinstance(own, int) else 0) + sum(_failed_reads(value) for value in result.values())
    if isinstance(result, list):
        return sum(_failed_reads(value) for value in result)
    return 0
