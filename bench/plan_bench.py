"""Training-aware caching benchmark: a shuffled-sample loader over shards, with and without a plan.

    python -m bench.plan_bench --quick          # ~3 minutes
    python -m bench.plan_bench --out results/   # bigger cache and datasets

Everything runs on this machine (as root, for FUSE): one hub serving three
datasets of random shards at 0.5x, 1x and 2x the cache size, behind the WAN
emulator (`bench.wan`, 60 ms RTT and a rate cap by default), and for
each dataset and mode a fresh cachefs mount with an empty cache:

- `plan`: the loader's sampler is a `cachefs.plan.PlanSampler`, so each
  epoch's reads go to the daemon before the epoch starts;
- `no plan`: the same loader and order, cachefs as before (TinyLFU
  admission, per-file read-ahead); epochs are marked with
  `cachefs.plan.mark_epoch`, which only starts a new statistics record;
- `LRU`, `Belady`: simulated offline on the same block trace (cachefs has
  no LRU mode; Belady's optimum needs the future).

The loader works like a PyTorch DataLoader with `workers` worker threads
and `prefetch_factor` 2: worker w reads the samples of batches w, w+W, ...
one after the other (pread, `POSIX_FADV_RANDOM`, the pages dropped after
each read so the kernel's page cache serves nothing), the consumer takes
batches in order and spends `compute_s` on each (the accelerator). A
sample is a `sample_bytes` window of a shard; by default one block, so
each block is read once per epoch and the offline simulations see exactly
the trace the cache sees.

Reported per epoch: samples/s, accelerator busy % (compute time / wall
time), hit ratio (the share of the bytes read that did not cross the WAN
this epoch: 1 - WAN bytes / bytes read), the daemon's own hit ratio (a
block prefetched along the plan counts as a hit there), stall seconds (the
accelerator waiting for data), WAN bytes (fetched from the hub), and the
Belady and LRU hit ratios of the trace.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cachefs import plan as cachefs_plan
from cachefs.processes import wait_for_pid

log = logging.getLogger(__name__)

MiB = 1 << 20
SHARD_BYTES = 32 * MiB
RATIOS = (0.5, 1.0, 2.0)
MARKER = ".plan-bench-dataset"
START_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    cache_bytes: int = 512 * MiB
    block_bytes: int = 1 * MiB
    sample_bytes: int = 1 * MiB
    epochs: int = 3
    workers: int = 4
    batch_size: int = 8
    compute_s: float = 0.1  # per batch: demand = batch_size x sample_bytes / compute_s
    prefetch_factor: int = 2
    rtt_ms: float = 60.0
    rate_mbit: float | None = 1000.0
    seed: int = 0

    @property
    def demand_bytes_per_s(self) -> float:
        return self.batch_size * self.sample_bytes / self.compute_s


QUICK = BenchConfig()
FULL = BenchConfig(cache_bytes=2048 * MiB, epochs=4)


# -- processes --------------------------------------------------------------------------------


class Process:
    """A server subprocess that prints `<prefix>URL` once listening."""

    def __init__(self, argv: Sequence[str], prefix: str, log_path: Path) -> None:
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file,
                                         text=True, start_new_session=True)
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        found = threading.Event()

        def drain() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.strip())
                if line.startswith(prefix):
                    found.set()
            found.set()

        self._thread = threading.Thread(target=drain, daemon=True)
        self._thread.start()
        if not found.wait(START_TIMEOUT_S) or not any(line.startswith(prefix) for line in self.lines):
            self.stop()
            raise RuntimeError(f"{argv[2]} did not start; see {log_path}")
        self.url = next(line for line in self.lines if line.startswith(prefix))[len(prefix):].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        self._thread.join(5)


def start_hub_behind_wan(stack: contextlib.ExitStack, data_root: Path, work: Path, rtt_ms: float,
                         rate_mbit: float | None) -> tuple[Process, Process]:
    """A hub serving data_root and the WAN emulator in front of it, both stopped when `stack` closes."""
    hub = Process([sys.executable, "-m", "hubserver", "serve", "--root", str(data_root), "--listen", "127.0.0.1:0"],
                  "cachefs-hub listening on ", work / "hub.log")
    stack.callback(hub.stop)
    wan_argv = [sys.executable, "-m", "bench.wan", "--target", hub.url.removeprefix("http://"),
                "--delay-ms", str(rtt_ms / 2)]
    if rate_mbit:
        wan_argv += ["--rate-mbit", str(rate_mbit)]
    wan = Process(wan_argv, "wan listening on ", work / "wan.log")
    stack.callback(wan.stop)
    return hub, wan


class Mount:
    """A cachefs mount made with the CLI on a given cache dir (kept, so a later mount can start warm)."""

    def __init__(self, hub_url: str, mountpoint: Path, cache_dir: Path, options: Sequence[str]) -> None:
        self.mountpoint, self.cache_dir = mountpoint, cache_dir
        mountpoint.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "cachefs", "mount", hub_url, str(mountpoint),
                                 "--cache-dir", str(cache_dir), *options],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"cachefs mount failed: {result.stderr.strip()}")
        self.pid = int((cache_dir / "lock").read_text().strip())

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = json.loads(os.getxattr(self.mountpoint, "user.cachefs.stats"))
        return stats

    def unmount(self) -> None:
        result = subprocess.run([sys.executable, "-m", "cachefs", "unmount", str(self.mountpoint)],
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
        if result.returncode != 0:  # busy (readers cut short): detach it, the daemon then exits
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=30)
        wait_for_pid(self.pid, 30)


# -- the dataset --------------------------------------------------------------------------------


def write_shards(directory: Path, count: int, shard_bytes: int, marker: str = MARKER) -> None:
    """`count` random shards of `shard_bytes` in `directory` (kept when its `marker` file says they are there)."""
    spec = f"{count} x {shard_bytes}\n"
    if not (directory / marker).exists() or (directory / marker).read_text() != spec:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for index in range(count):
            with open(directory / f"shard-{index:04d}.bin", "wb") as out:
                for _ in range(shard_bytes // (4 * MiB)):
                    out.write(os.urandom(4 * MiB))
        (directory / marker).write_text(spec)


def build_datasets(root: Path, config: BenchConfig) -> dict[float, list[Path]]:
    """Shards for each ratio under root/ratio-R/ (reused when already there)."""
    datasets = {}
    for ratio in RATIOS:
        directory = root / f"ratio-{ratio:g}"
        count = max(1, round(ratio * config.cache_bytes / SHARD_BYTES))
        write_shards(directory, count, SHARD_BYTES)
        datasets[ratio] = sorted(directory.glob("shard-*.bin"))
    return datasets


def samples_of(shards: list[Path], sample_bytes: int) -> list[tuple[int, int]]:
    """(shard index, offset) of every whole sample."""
    return [(index, offset) for index, shard in enumerate(shards)
            for offset in range(0, shard.stat().st_size - sample_bytes + 1, sample_bytes)]


class Shuffled:
    """The sampler: a seeded permutation per epoch (set_epoch, as DistributedSampler)."""

    def __init__(self, count: int, seed: int) -> None:
        self.count, self.seed, self.epoch = count, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.count))
        random.Random(self.seed * 1000 + self.epoch).shuffle(order)
        return iter(order)


# -- the loader ---------------------------------------------------------------------------------


@dataclasses.dataclass
class EpochResult:
    samples: int
    wall_s: float
    compute_s: float
    stall_s: float
    errors: int
    batch_waits_s: list[float]  # how long the accelerator waited for each batch

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    @property
    def busy_pct(self) -> float:
        return 100 * self.compute_s / self.wall_s


def run_epoch(paths: list[str], samples: list[tuple[int, int]], order: Iterator[int], config: BenchConfig,
              started: float) -> EpochResult:
    """Feed the epoch's shuffled samples through the worker threads; the consumer computes on each batch."""
    indices = list(order)
    batches = [indices[start:start + config.batch_size] for start in range(0, len(indices), config.batch_size)]
    done = [threading.Event() for _ in batches]
    errors = [0]
    consumed = [0]
    progress = threading.Condition()

    def worker(number: int) -> None:
        fds: dict[int, int] = {}
        try:
            for batch_no in range(number, len(batches), config.workers):
                with progress:  # at most prefetch_factor batches of this worker ahead of the consumer
                    while batch_no - consumed[0] >= config.workers * config.prefetch_factor:
                        progress.wait()
                for index in batches[batch_no]:
                    shard, offset = samples[index]
                    fd = fds.get(shard)
                    if fd is None:
                        fd = fds[shard] = os.open(paths[shard], os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    try:
                        if len(os.pread(fd, config.sample_bytes, offset)) != config.sample_bytes:
                            errors[0] += 1
                    except OSError:
                        errors[0] += 1
                    os.posix_fadvise(fd, offset, config.sample_bytes, os.POSIX_FADV_DONTNEED)
                done[batch_no].set()
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(number,), daemon=True) for number in range(config.workers)]
    for thread in threads:
        thread.start()
    compute_s = 0.0
    waits = []
    for batch_no in range(len(batches)):
        waited = time.monotonic()
        done[batch_no].wait()
        waits.append(time.monotonic() - waited)
        with progress:
            consumed[0] = batch_no + 1
            progress.notify_all()
        began = time.monotonic()
        time.sleep(config.compute_s)  # the accelerator's forward and backward pass
        compute_s += time.monotonic() - began
    for thread in threads:
        thread.join()
    wall_s = time.monotonic() - started
    return EpochResult(len(indices), wall_s, compute_s, wall_s - compute_s, errors[0], waits)


# -- offline policies -----------------------------------------------------------------------------


def belady_hits(trace: list[list[int]], capacity: int) -> list[int]:
    """Hits per epoch of Belady's optimal replacement (with bypass) on the block trace."""
    flat = [block for epoch in trace for block in epoch]
    next_use = [0] * len(flat)
    last: dict[int, int] = {}
    for index in range(len(flat) - 1, -1, -1):
        next_use[index] = last.get(flat[index], len(flat) + index)
        last[flat[index]] = index
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits, position = [], 0
    for epoch in trace:
        count = 0
        for block in epoch:
            use = next_use[position]
            position += 1
            if block in cached:
                count += 1
            elif len(cached) >= capacity:
                while True:
                    negative, victim = heapq.heappop(heap)
                    if cached.get(victim) == -negative:
                        break
                if -negative < use:  # the victim is needed sooner: do not cache this block
                    heapq.heappush(heap, (negative, victim))
                    continue
                del cached[victim]
            cached[block] = use
            heapq.heappush(heap, (-use, block))
        hits.append(count)
    return hits


def lru_hits(trace: list[list[int]], capacity: int) -> list[int]:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for epoch in trace:
        count = 0
        for block in epoch:
            if block in cache:
                count += 1
                cache.move_to_end(block)
            else:
                cache[block] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
        hits.append(count)
    return hits


def block_trace(samples: list[tuple[int, int]], orders: list[list[int]], config: BenchConfig) -> list[list[int]]:
    """The blocks each epoch reads, in order (a sample spanning blocks reads each)."""
    trace = []
    for order in orders:
        blocks: list[int] = []
        for index in order:
            shard, offset = samples[index]
            first, last = offset // config.block_bytes, (offset + config.sample_bytes - 1) // config.block_bytes
            blocks.extend(shard << 32 | block for block in range(first, last + 1))
        trace.append(blocks)
    return trace


# -- one run --------------------------------------------------------------------------------------


def run_mode(mode: str, hub_url: str, shards: list[Path], relative: str, work: Path, config: BenchConfig,
             ) -> tuple[list[dict[str, Any]], list[list[int]]]:
    mountpoint, cache_dir = work / f"mnt-{mode}", work / f"cache-{mode}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    mount = Mount(hub_url, mountpoint, cache_dir, [
        "--cache-size", str(config.cache_bytes), "--block-size", str(config.block_bytes), "--fetch-timeout", "60"])
    try:
        paths = [str(mountpoint / relative / shard.name) for shard in shards]
        samples = samples_of(shards, config.sample_bytes)
        inner = Shuffled(len(samples), config.seed)
        sampler = cachefs_plan.PlanSampler(
            inner, lambda index: [(paths[samples[index][0]], samples[index][1], config.sample_bytes)], strict=True)
        rows, orders = [], []
        for epoch in range(1, config.epochs + 1):
            before = mount.stats()
            started = time.monotonic()
            if mode == "plan":
                sampler.set_epoch(epoch)
                order = list(sampler)  # streams the epoch's plan to the daemon first
            else:
                cachefs_plan.mark_epoch(mountpoint, epoch)
                inner.set_epoch(epoch)
                order = list(inner)
            orders.append(order)
            result = run_epoch(paths, samples, iter(order), config, started)
            after = mount.stats()
            rows.append(_row(mode, epoch, result, before, after, config))
            log.info("%s epoch %d: %s", mode, epoch, rows[-1])
        sampler.close()
        return rows, orders
    finally:
        mount.unmount()
        shutil.rmtree(cache_dir, ignore_errors=True)


def _row(mode: str, epoch: int, result: EpochResult, before: dict[str, Any], after: dict[str, Any],
         config: BenchConfig) -> dict[str, Any]:
    def delta(name: str) -> float:
        return after[name] - before[name]

    read_bytes = result.samples * config.sample_bytes
    looked_up = delta("block_hits") + delta("block_misses")
    record: dict[str, Any] = next((r for r in after["training"]["epochs"] if r["epoch"] == epoch), {})
    return {
        "mode": mode,
        "epoch": epoch,
        "samples": result.samples,
        "errors": result.errors,
        "wall_s": result.wall_s,
        "samples_per_s": result.samples_per_s,
        "busy_pct": result.busy_pct,
        "stall_s": result.stall_s,
        "first_batch_s": result.batch_waits_s[0] if result.batch_waits_s else None,
        "hit_ratio": 1 - delta("fetched_bytes") / read_bytes,
        "daemon_hit_ratio": delta("block_hits") / looked_up if looked_up else None,
        "reader_stall_s": delta("stall_seconds"),
        "wan_bytes": int(delta("fetched_bytes")),
        "plan_prefetch_blocks": int(delta("plan_prefetch_blocks")),
        "plan_prefetch_wasted_blocks": int(delta("plan_prefetch_wasted_blocks")),
        "time_to_warm_s": record.get("time_to_warm_s"),
        "lookahead_blocks": after["training"]["lookahead_blocks"],
    }


def run(config: BenchConfig, work: Path, out: Path | None) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    data_root = work / "data"
    datasets = build_datasets(data_root, config)
    results: dict[str, Any] = {"config": dataclasses.asdict(config), "datasets": []}
    with contextlib.ExitStack() as stack:
        hub, wan = start_hub_behind_wan(stack, data_root, work, config.rtt_ms, config.rate_mbit)
        for ratio, shards in datasets.items():
            dataset_bytes = sum(shard.stat().st_size for shard in shards)
            entry: dict[str, Any] = {"ratio": ratio, "dataset_bytes": dataset_bytes, "rows": []}
            orders: list[list[int]] = []
            for mode in ("plan", "no plan"):
                rows, orders = run_mode(mode, wan.url, shards, f"ratio-{ratio:g}", work, config)
                entry["rows"].extend(rows)
            samples = samples_of(shards, config.sample_bytes)
            trace = block_trace(samples, orders, config)
            capacity = config.cache_bytes // config.block_bytes
            for name, hits in (("belady", belady_hits(trace, capacity)), ("lru", lru_hits(trace, capacity))):
                entry[name] = [count / len(blocks) for count, blocks in zip(hits, trace, strict=True)]
            results["datasets"].append(entry)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


# -- the report --------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    config = BenchConfig(**results["config"])
    rate = f"{config.rate_mbit:g} Mbit/s" if config.rate_mbit else "no rate cap"
    lines = [
        f"cache {config.cache_bytes / MiB:.0f} MiB, blocks {config.block_bytes / MiB:g} MiB, samples "
        f"{config.sample_bytes / MiB:g} MiB, {config.workers} workers x batch {config.batch_size}, "
        f"{1000 * config.compute_s:.0f} ms compute per batch: demand {config.demand_bytes_per_s / MiB:.0f} MiB/s; "
        f"link {config.rtt_ms:g} ms RTT, {rate}",
        "",
        f"{'data/cache':>10} {'mode':<8} {'epoch':>5} {'samples/s':>9} {'busy %':>7} {'hit %':>6} {'belady %':>8} "
        f"{'lru %':>6} {'daemon hit %':>12} {'stall s':>8} {'1st batch s':>11} {'WAN MiB':>8} {'warm s':>6}",
    ]
    checks = []
    for entry in results["datasets"]:
        ratio, dataset_bytes = entry["ratio"], entry["dataset_bytes"]
        for row in entry["rows"]:
            epoch = row["epoch"]
            belady, lru = entry["belady"][epoch - 1], entry["lru"][epoch - 1]
            daemon = f"{100 * row['daemon_hit_ratio']:.1f}" if row["daemon_hit_ratio"] is not None else "-"
            warm = f"{row['time_to_warm_s']:.1f}" if row["time_to_warm_s"] is not None else "-"
            lines.append(
                f"{ratio:>9g}x {row['mode']:<8} {epoch:>5} {row['samples_per_s']:>9.1f} {row['busy_pct']:>7.1f} "
                f"{100 * row['hit_ratio']:>6.1f} {100 * belady:>8.1f} {100 * lru:>6.1f} {daemon:>12} "
                f"{row['stall_s']:>8.2f} {row['first_batch_s']:>11.2f} {row['wan_bytes'] / MiB:>8.0f} {warm:>6}")
            if row["mode"] != "plan":
                continue
            if epoch == 1 and (config.rate_mbit is None or config.rate_mbit * 1e6 / 8 > config.demand_bytes_per_s):
                checks.append((f"{ratio:g}x plan, cold epoch 1: busy {row['busy_pct']:.1f} % >= 95 %",
                               row["busy_pct"] >= 95))
            if ratio == 2.0 and epoch >= 2:
                checks.append((f"2x plan, epoch {epoch}: hit {100 * row['hit_ratio']:.1f} % >= 90 % of Belady "
                               f"{100 * belady:.1f} %", row["hit_ratio"] >= 0.9 * belady))
                bound = (1 - row["hit_ratio"]) * dataset_bytes
                checks.append((f"2x plan, epoch {epoch}: WAN {row['wan_bytes'] / MiB:.0f} MiB <= (1 - hit) x dataset "
                               f"{bound / MiB:.0f} MiB (Belady's: {(1 - belady) * dataset_bytes / MiB:.0f} MiB)",
                               row["wan_bytes"] <= bound + config.block_bytes))
        lines.append("")
    lines.append("targets:")
    lines.extend(f"  {'PASS' if ok else 'FAIL'}  {text}" for text, ok in checks)
    lines.append("")
    lines.append("hit % = 1 - WAN bytes / bytes read (each block is read once per epoch); daemon hit % counts "
                 "blocks prefetched along the plan as hits; lru and belady are simulated on the same block trace; "
                 "stall s = wall - compute (the accelerator idle), of which 1st batch s waiting for the first batch; "
                 "warm s = the daemon's time to warm within the epoch.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 MiB cache, 3 epochs (about 3 minutes)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/cachefs-plan-bench"),
                        help="datasets (kept for the next run), mounts and caches (default: /tmp/cachefs-plan-bench)")
    parser.add_argument("--out", type=Path, help="write plan_bench.json here")
    parser.add_argument("--rtt-ms", type=float, help="round trip time of the emulated WAN (default: 60)")
    parser.add_argument("--rate-mbit", type=float, help="WAN rate cap in Mbit/s, 0 for none (default: 1000)")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--cache-mib", type=int)
    parser.add_argument("--compute-ms", type=float, help="emulated accelerator time per batch")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(message)s")
    if os.geteuid() != 0:
        print("plan_bench: needs root (FUSE mounts, page cache control)", file=sys.stderr)
        return 2
    config = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {}
    if args.rtt_ms is not None:
        overrides["rtt_ms"] = args.rtt_ms
    if args.rate_mbit is not None:
        overrides["rate_mbit"] = args.rate_mbit or None
    if args.epochs is not None:
        overrides["epochs"] = args.epochs
    if args.cache_mib is not None:
        overrides["cache_bytes"] = args.cache_mib * MiB
    if args.compute_ms is not None:
        overrides["compute_s"] = args.compute_ms / 1000
    if args.workers is not None:
        overrides["workers"] = args.workers
    config = dataclasses.replace(config, **overrides)
    began = time.monotonic()
    results = run(config, args.work_dir, args.out)
    print(report(results))
    print(f"\n(run took {math.ceil(time.monotonic() - began)} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
