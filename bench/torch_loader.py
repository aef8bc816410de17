"""torch's own DataLoader over shards: local disk, cachefs cold without and with a PlanSampler, cachefs warm.

    python -m bench.torch_loader                       # 4 x 64 MiB and 12 x 64 MiB, about 3 minutes
    python -m bench.torch_loader --shards 4 --out results/

Everything runs on this machine (as root, for FUSE and dropping the page
cache): one hub serving the datasets behind the WAN emulator
(`bench.wan`, 60 ms RTT and 1 Gbit/s by default). Each run is one
epoch of `torch.utils.data.DataLoader` (worker processes, persistent,
`RandomSampler` with the same seed in every run) whose samples are
`sample_bytes` windows of the shards, read with os.pread after
POSIX_FADV_RANDOM; the training loop sleeps `compute_s` per batch (the
accelerator). The spoke's block size is the one a PlanSampler advises for
the samples (256 KiB for 256 KiB samples; `--block-kib 1024`, the spoke's
default, shows what blocks 4x the samples cost). Before each run the page cache is dropped and cachefs is
mounted afresh: `cold` with an empty cache, `warm` on the cache the cold
PlanSampler run filled.

Reported per run: samples/s, busy % (compute time / wall time),
first-batch latency (from creating the loader's iterator, workers starting
included), the plan's hand-over time (until the daemon accepted all of
it), the stall time after the first batch, WAN bytes, and the CPU seconds
of the daemon, the hub, the emulator and the loader (training process and
its workers) read from /proc/PID/stat, beside the machine's idle time. Beside
the runs, bounds computed from the epoch's order: the best cold epoch over
this link with a plan (fetched in blocks, or in samples) and without one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cachefs import plan as cachefs_plan
from cachefs.bench.workloads import drop_page_cache, machine_cpu_seconds

from . import processes
from .plan_bench import Mount, start_hub_behind_wan, write_shards

log = logging.getLogger(__name__)

MiB = 1 << 20
KiB = 1 << 10
MARKER = ".torch-bench-dataset"
MODES = ("local", "cold", "cold plan", "warm")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    shard_counts: tuple[int, ...] = (4, 12)
    shard_bytes: int = 64 * MiB
    sample_bytes: int = 256 * KiB
    batch_size: int = 16
    workers: int = 4
    compute_s: float = 0.05  # per batch: demand = batch_size x sample_bytes / compute_s (80 MiB/s)
    rtt_ms: float = 60.0
    rate_mbit: float | None = 1000.0
    cache_bytes: int = 4096 * MiB
    # The spoke's block size; None: the one a PlanSampler advises for the samples
    # (the largest power of two no larger than a sample, at most the spoke's 1 MiB default).
    block_bytes: int | None = None
    spoke_args: tuple[str, ...] = ()
    seed: int = 0

    @property
    def demand_bytes_per_s(self) -> float:
        return self.batch_size * self.sample_bytes / self.compute_s

    @property
    def block_size(self) -> int:
        if self.block_bytes is not None:
            return self.block_bytes
        return max(64 * KiB, min(MiB, 1 << (self.sample_bytes.bit_length() - 1)))


# -- processes and the machine ----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far; 0 if it is gone."""
    return processes.cpu_seconds(pid) or 0.0


def children(pid: int) -> list[int]:
    """The direct child processes of `pid` (the DataLoader's workers of this process)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found.extend(int(child) for child in listed.read().split())
    return found


def machine_idle_s() -> float:
    """Idle + iowait seconds of all cores since boot (from /proc/stat)."""
    seconds = machine_cpu_seconds()
    if seconds is None:
        raise OSError("cannot read the machine's CPU times from /proc/stat")
    return seconds[1]


# -- the dataset and one epoch ------------------------------------------------------------------


def build_dataset(root: Path, count: int, shard_bytes: int) -> Path:
    """`count` random shards in root/COUNTxSIZE/ (reused when already there)."""
    directory = root / f"{count}x{shard_bytes // MiB}M"
    write_shards(directory, count, shard_bytes, MARKER)
    return directory


def make_dataset_class() -> type:
    """The torch Dataset of shard windows (built on first use: torch is imported only when the bench runs)."""
    import torch
    from torch.utils.data import Dataset

    class ShardWindows(Dataset):
        def __init__(self, paths: list[str], shard_bytes: int, window: int) -> None:
            self.paths, self.window = paths, window
            self.samples = [(number, offset) for number in range(len(paths))
                            for offset in range(0, shard_bytes - window + 1, window)]
            self._fds: dict[int, int] = {}  # opened lazily in each worker process

        def __len__(self) -> int:
            return len(self.samples)

        def reads_of(self, index: int) -> list[tuple[str, int, int]]:
            number, offset = self.samples[index]
            return [(self.paths[number], offset, self.window)]

        def __getitem__(self, index: int) -> torch.Tensor:
            number, offset = self.samples[index]
            fd = self._fds.get(number)
            if fd is None:
                fd = self._fds[number] = os.open(self.paths[number], os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            data = os.pread(fd, self.window, offset)
            if len(data) != self.window:
                raise OSError(f"short read of {self.paths[number]} at {offset}")
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    return ShardWindows


def run_epoch(paths: list[str], config: BenchConfig, planned: bool, pids: dict[str, int]) -> dict[str, Any]:
    """One epoch of a fresh DataLoader; times, stalls and the CPU seconds of `pids` and of the loader."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    dataset = make_dataset_class()(paths, config.shard_bytes, config.sample_bytes)
    shuffle = RandomSampler(dataset, generator=torch.Generator().manual_seed(config.seed))
    planner = cachefs_plan.PlanSampler(shuffle, reads_of=dataset.reads_of) if planned else None
    loader = DataLoader(dataset, batch_size=config.batch_size, sampler=shuffle if planner is None else planner,
                        num_workers=config.workers, persistent_workers=True)
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    me = os.getpid()
    loader_before = cpu_seconds(me)
    idle_before = machine_idle_s()
    handed_over: list[float] = []
    started = time.monotonic()
    batches = iter(loader)  # starts the workers; a PlanSampler hands the plan over from here
    if planner is not None:
        def watch() -> None:
            planner.wait()
            handed_over.append(time.monotonic() - started)
        threading.Thread(target=watch, daemon=True).start()
    waits, compute_s, samples = [], 0.0, 0
    waited = started
    while True:
        batch = next(batches, None)
        if batch is None:
            break
        waits.append(time.monotonic() - waited)  # the first one includes starting the workers
        samples += len(batch)
        began = time.monotonic()
        time.sleep(config.compute_s)  # the accelerator's forward and backward pass
        compute_s += time.monotonic() - began
        waited = time.monotonic()
    wall_s = time.monotonic() - started
    workers = [pid for pid in children(me) if pid not in pids.values()]  # the hub and emulator are children too
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    cpu["loader"] = cpu_seconds(me) - loader_before + sum(cpu_seconds(pid) for pid in workers)
    idle_s = machine_idle_s() - idle_before
    del batches, loader  # ends the persistent workers: they hold files in the mount open
    gc.collect()
    if planner is not None:
        planner.close()
    return {
        "samples": samples,
        "wall_s": wall_s,
        "compute_s": compute_s,
        "samples_per_s": samples / wall_s,
        "busy_pct": 100 * compute_s / wall_s,
        "first_batch_s": waits[0],
        "stall_after_first_s": sum(waits[1:]),
        "stall_first_quarter_s": sum(waits[1:len(waits) // 4]),
        "end_s": started + wall_s - waited,  # after the last batch's compute, until the loader said it was done
        "handover_s": handed_over[0] if handed_over else None,
        "batch_waits_s": [round(wait, 4) for wait in waits],
        "cpu_s": cpu,
        "idle_s": idle_s,
        "cores": os.cpu_count(),
    }


def epoch_order(count: int, seed: int) -> list[int]:
    """The sample order of every run's RandomSampler (the same seed, the same permutation)."""
    import torch
    from torch.utils.data import RandomSampler

    return list(RandomSampler(range(count), generator=torch.Generator().manual_seed(seed)))


def link_bound_s(order: list[int], config: BenchConfig, fetch_bytes: int) -> float:
    """The shortest cold epoch any prefetcher following the plan could reach over this link.

    The link carries the dataset in `fetch_bytes` units, each fetched once,
    back to back in the order the epoch first needs them, starting when the
    epoch starts; a batch is ready when all its units have arrived, and the
    accelerator spends `compute_s` on each batch in turn. Worker start-up
    and per-read costs are left out.
    """
    rate = (config.rate_mbit or math.inf) * 1e6 / 8
    samples_per_shard = config.shard_bytes // config.sample_bytes
    arrival: dict[tuple[int, int], float] = {}
    clock = config.rtt_ms / 1000
    finished = 0.0
    for start in range(0, len(order), config.batch_size):
        ready = 0.0
        for index in order[start:start + config.batch_size]:
            shard, offset = divmod(index, samples_per_shard)
            first = offset * config.sample_bytes // fetch_bytes
            last = ((offset + 1) * config.sample_bytes - 1) // fetch_bytes
            for unit in range(first, last + 1):
                if (shard, unit) not in arrival:
                    clock += fetch_bytes / rate
                    arrival[shard, unit] = clock
                ready = max(ready, arrival[shard, unit])
        finished = max(finished, ready) + config.compute_s
    return finished


PREFETCH_FACTOR = 2  # torch's default: batches handed to each worker ahead of the training loop


def no_plan_bound_s(order: list[int], config: BenchConfig, fetch_bytes: int) -> float:
    """The shortest cold epoch a loader without a plan could reach over this link.

    Not knowing the order, the best a prefetcher can do is to fetch the
    whole dataset (it fits the cache) in an order of its own, `fetch_bytes`
    units back to back at the link's rate from the start; a sample whose
    units have not arrived is a demand miss, which its worker waits for (one
    RTT plus the unit's transfer, or until the unit arrives if sooner; its
    bytes left out of the link's budget). Each worker reads the samples of
    its batches one after another, batch b in worker b mod `workers`, handed
    to it when batch b - workers x PREFETCH_FACTOR reached the training
    loop; the accelerator spends `compute_s` on each batch in turn.
    """
    rate = (config.rate_mbit or math.inf) * 1e6 / 8
    rtt_s = config.rtt_ms / 1000
    samples_per_shard = config.shard_bytes // config.sample_bytes
    units_per_shard = -(-config.shard_bytes // fetch_bytes)
    arrival: dict[tuple[int, int], float] = {}  # units fetched on demand

    def filled(shard: int, unit: int) -> float:
        return rtt_s + (shard * units_per_shard + unit + 1) * fetch_bytes / rate

    batches = [order[start:start + config.batch_size] for start in range(0, len(order), config.batch_size)]
    worker_free = [0.0] * config.workers
    taken: list[float] = []  # when the training loop got each batch
    finished = 0.0
    for number, batch in enumerate(batches):
        worker = number % config.workers
        ahead = number - config.workers * PREFETCH_FACTOR
        clock = max(worker_free[worker], taken[ahead] if ahead >= 0 else 0.0)
        for index in batch:
            shard, offset = divmod(index, samples_per_shard)
            first = offset * config.sample_bytes // fetch_bytes
            last = ((offset + 1) * config.sample_bytes - 1) // fetch_bytes
            ready = clock
            for unit in range(first, last + 1):
                at = arrival.get((shard, unit), filled(shard, unit))
                if at > clock:
                    at = arrival[shard, unit] = min(at, clock + rtt_s + fetch_bytes / rate)
                ready = max(ready, at)
            clock = ready
        worker_free[worker] = clock
        taken.append(max(clock, finished))
        finished = taken[-1] + config.compute_s
    return finished


# -- the runs ---------------------------------------------------------------------------------------


def run(config: BenchConfig, work: Path, out: Path | None) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    data_root = work / "data"
    datasets = {count: build_dataset(data_root, count, config.shard_bytes) for count in config.shard_counts}
    results: dict[str, Any] = {"config": dataclasses.asdict(config), "datasets": []}
    options = ["--cache-size", str(config.cache_bytes), "--block-size", str(config.block_size), "--fetch-timeout", "60",
               *config.spoke_args]
    with contextlib.ExitStack() as stack:
        hub, wan = start_hub_behind_wan(stack, data_root, work, config.rtt_ms, config.rate_mbit)
        servers = {"hub": hub.proc.pid, "emulator": wan.proc.pid}
        for count, directory in datasets.items():
            order = epoch_order(count * (config.shard_bytes // config.sample_bytes), config.seed)
            entry: dict[str, Any] = {"shards": count, "dataset_bytes": count * config.shard_bytes, "runs": {},
                                     "bound_block_s": link_bound_s(order, config, config.block_size),
                                     "bound_sample_s": link_bound_s(order, config, config.sample_bytes),
                                     "bound_no_plan_s": no_plan_bound_s(order, config, config.block_size)}
            names = sorted(path.name for path in directory.glob("shard-*.bin"))
            cache_dir = work / f"cache-{count}"
            for mode in MODES:
                if mode != "warm":
                    shutil.rmtree(cache_dir, ignore_errors=True)
                drop_page_cache()
                if mode == "local":
                    row = run_epoch([str(directory / name) for name in names], config, False, servers)
                else:
                    mount = Mount(wan.url, work / "mnt", cache_dir, options)
                    try:
                        before = mount.stats()
                        paths = [str(mount.mountpoint / directory.name / name) for name in names]
                        row = run_epoch(paths, config, mode == "cold plan", {"daemon": mount.pid, **servers})
                        after = mount.stats()
                    finally:
                        mount.unmount()
                    row["wan_bytes"] = after["fetched_bytes"] - before["fetched_bytes"]
                    row["plan_prefetch_blocks"] = after["plan_prefetch_blocks"] - before["plan_prefetch_blocks"]
                    row["reader_stall_s"] = after["stall_seconds"] - before["stall_seconds"]
                    row["training"] = after["training"]
                entry["runs"][mode] = row
                log.info("%d shards, %s: %s", count, mode, row)
            shutil.rmtree(cache_dir, ignore_errors=True)
            results["datasets"].append(entry)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "torch_loader.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


# -- the report --------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    config = BenchConfig(**{**results["config"], "shard_counts": tuple(results["config"]["shard_counts"]),
                            "spoke_args": tuple(results["config"]["spoke_args"])})
    rate = f"{config.rate_mbit:g} Mbit/s" if config.rate_mbit else "no rate cap"
    lines = [
        f"torch DataLoader: {config.workers} worker processes (persistent), batch {config.batch_size}, "
        f"{config.sample_bytes / KiB:g} KiB samples (os.pread, POSIX_FADV_RANDOM), {1000 * config.compute_s:.0f} ms "
        f"compute per batch: demand {config.demand_bytes_per_s / MiB:.0f} MiB/s; link {config.rtt_ms:g} ms RTT, {rate}",
        "",
        "| dataset | local disk | cachefs cold, no plan | cachefs cold, PlanSampler | cachefs warm "
        f"| link bound, {config.block_size / KiB:g} KiB blocks | link bound, sample-sized fetches "
        "| bound without a plan |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["datasets"]:
        compute_s = len(entry["runs"]["local"]["batch_waits_s"]) * config.compute_s
        cells = [f"{entry['runs'][mode]['wall_s']:.1f} s, {entry['runs'][mode]['busy_pct']:.0f} %" for mode in MODES]
        cells += [f"{entry[key]:.1f} s, {100 * compute_s / entry[key]:.0f} %"
                  for key in ("bound_block_s", "bound_sample_s", "bound_no_plan_s")]
        lines.append(f"| {entry['shards']} x {config.shard_bytes / MiB:g} MiB | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| dataset | run | samples/s | busy % | 1st batch s | stall after s | of it in 1st quarter | plan s | WAN MiB "
        "| CPU s: daemon | hub | emulator | loader | idle s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["datasets"]:
        for mode in MODES:
            row = entry["runs"][mode]
            cpu = row["cpu_s"]
            plan = f"{row['handover_s']:.2f}" if row.get("handover_s") is not None else "-"
            wan = f"{row['wan_bytes'] / MiB:.0f}" if "wan_bytes" in row else "-"
            daemon = f"{cpu['daemon']:.2f}" if "daemon" in cpu else "-"
            lines.append(
                f"| {entry['shards']} x {config.shard_bytes / MiB:g} MiB | {mode} | {row['samples_per_s']:.0f} | "
                f"{row['busy_pct']:.1f} | {row['first_batch_s']:.2f} | {row['stall_after_first_s']:.2f} | "
                f"{row['stall_first_quarter_s']:.2f} | {plan} | "
                f"{wan} | {daemon} | {cpu['hub']:.2f} | {cpu['emulator']:.2f} | {cpu['loader']:.2f} | "
                f"{row['idle_s']:.1f} |")
    lines += [
        "",
        "link bound: the shortest cold epoch a prefetcher following the plan perfectly could reach, the link "
        "carrying each fetch unit once, back to back, in the order the epoch first needs it (worker start-up and "
        "per-read costs left out): random samples smaller than a block make the epoch's first batches need most "
        "blocks at once. bound without a plan: the same link fetching the whole dataset in blocks in an order of "
        "its own (the epoch's is unknown), each worker waiting one RTT for every sample not yet there "
        "(torch's 2 batches ahead per worker).",
        "busy % = compute / wall; 1st batch s: from creating the loader's iterator (workers starting) to the first "
        "batch; stall after s: waiting for batches after the first (of it in the epoch's first quarter of "
        "batches); plan s: until the daemon accepted the whole plan; CPU s: user + system seconds per run "
        "(loader = training process and its workers); idle s: idle "
        f"core-seconds of the machine's {results['datasets'][0]['runs']['local']['cores']} cores during the run.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.torch_loader", description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/var/tmp/cachefs-torch-bench"),
                        help="datasets (kept for the next run), mounts and caches (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="write torch_loader.json here")
    parser.add_argument("--shards", help="comma-separated shard counts, one dataset each (default: 4,12)")
    parser.add_argument("--sample-kib", type=int, help="sample size in KiB (default: 256)")
    parser.add_argument("--block-kib", type=int,
                        help="the spoke's block size in KiB (default: the one a PlanSampler advises for the samples, "
                        "256 for 256 KiB samples; 1024, the spoke's default, gives the table of blocks 4x the samples)")
    parser.add_argument("--workers", type=int, help="DataLoader worker processes (default: 4)")
    parser.add_argument("--compute-ms", type=float, help="emulated accelerator time per batch (default: 50)")
    parser.add_argument("--rtt-ms", type=float, help="round trip time of the emulated WAN (default: 60)")
    parser.add_argument("--rate-mbit", type=float, help="WAN rate cap in Mbit/s, 0 for none (default: 1000)")
    parser.add_argument("--spoke-args", default="", help="extra `cachefs mount` options, one quoted string")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING, format="%(message)s")
    if os.geteuid() != 0:
        print("torch_loader: needs root (FUSE mounts, dropping the page cache)", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch_loader: needs torch (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {}
    if args.shards:
        overrides["shard_counts"] = tuple(int(count) for count in args.shards.split(","))
    if args.sample_kib is not None:
        overrides["sample_bytes"] = args.sample_kib * KiB
    if args.block_kib is not None:
        overrides["block_bytes"] = args.block_kib * KiB
    if args.workers is not None:
        overrides["workers"] = args.workers
    if args.compute_ms is not None:
        overrides["compute_s"] = args.compute_ms / 1000
    if args.rtt_ms is not None:
        overrides["rtt_ms"] = args.rtt_ms
    if args.rate_mbit is not None:
        overrides["rate_mbit"] = args.rate_mbit or None
    if args.spoke_args:
        overrides["spoke_args"] = tuple(shlex.split(args.spoke_args))
    config = dataclasses.replace(BenchConfig(), **overrides)
    began = time.monotonic()
    results = run(config, args.work_dir, args.out)
    print(report(results))
    print(f"\n(run took {math.ceil(time.monotonic() - began)} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
