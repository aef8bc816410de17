"""A training-like data loader: worker processes read shuffled fixed-size samples, the "accelerator" consumes batches.

The shape follows PyTorch's DataLoader with `num_workers=N`: each worker
process turns a batch of sample indices into data (here: `pread` of every
sample, checksummed, so no data is copied between processes); the main
process takes the batches *in order* and spends a fixed emulated compute
time on each (a sleep standing in for the forward/backward pass). The
accelerator is busy while it computes and idle while it waits for the next
batch, so busy % = compute time / wall time, as a GPU utilisation graph
would show it.

Samples are 4096 tokens x 4 bytes = 16 KiB windows of the shard files (C4
packed into 4096-token sequences). An epoch reads a fixed set of samples
(all of them, or a seeded random subset when the shards hold more) in a new
shuffled order each epoch.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import multiprocessing
import os
import queue
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from .workloads import FileEntry, percentile

log = logging.getLogger(__name__)

SAMPLE_BYTES = 4096 * 4  # 4096 tokens of 4 bytes
DIGEST_MODULUS = 1 << 64
# Bound on waiting for batches still in flight when an epoch is cut short.
DRAIN_TIMEOUT_S = 30.0
WORKER_START_TIMEOUT_S = 60.0

Sample = tuple[int, int]  # (file index, byte offset)
StatsFn = Callable[[], dict[str, Any] | None]


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """How the loader runs; every field has the default `cachefs bench` uses."""

    workers: int = 4  # DataLoader num_workers: processes reading samples
    batch_size: int = 32  # samples per batch
    sample_bytes: int = SAMPLE_BYTES
    compute_s: float = 0.04  # emulated accelerator time per batch (forward + backward)
    samples_per_epoch: int = 4096  # 0: every sample of the files
    epochs: int = 2
    prefetch_batches: int = 2  # batches in flight per worker, as PyTorch's prefetch_factor
    epoch_time_limit_s: float = 120.0
    seed: int = 0
    sample_interval_s: float = 0.5  # timeline resolution


@dataclasses.dataclass
class EpochResult:
    """One pass over the epoch's samples."""

    epoch: int
    samples: int
    bytes_read: int
    wall_s: float
    compute_s: float
    stall_s: float  # time the accelerator waited for data
    read_p50_ms: float
    read_p99_ms: float
    digest: int  # sum of crc32 of every sample read, mod 2**64: order independent
    errors: int
    complete: bool

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy_pct(self) -> float:
        return 100 * self.compute_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "samples_per_s": self.samples_per_s, "busy_pct": self.busy_pct}


@dataclasses.dataclass
class LoaderResult:
    """All epochs plus a timeline sampled every `sample_interval_s`."""

    config: LoaderConfig
    files: int
    epochs: list[EpochResult]
    timeline: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "files": self.files,
            "epochs": [epoch.as_dict() for epoch in self.epochs],
            "timeline": self.timeline,
        }


# -- sample selection --------------------------------------------------------------


def epoch_samples(files: Sequence[FileEntry], config: LoaderConfig) -> list[Sample]:
    """The samples every epoch reads: all whole windows, or a seeded random subset of them."""
    counts = [entry.size_bytes // config.sample_bytes for entry in files]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    total = starts[-1]
    wanted = total if config.samples_per_epoch <= 0 else min(total, config.samples_per_epoch)
    indices = range(total) if wanted == total else random.Random(config.seed).sample(range(total), wanted)
    samples = []
    for index in indices:
        file_index = bisect.bisect_right(starts, index) - 1
        samples.append((file_index, (index - starts[file_index]) * config.sample_bytes))
    return samples


def sample_digest(data: bytes) -> int:
    """The per-sample checksum the loader adds up."""
    return zlib.crc32(data)


# -- worker processes ---------------------------------------------------------------


def _worker(paths: list[str], sample_bytes: int, tasks: Any, results: Any) -> None:
    """Read the samples of each task; answer (epoch, batch, bytes, digest, latencies_s, errors)."""
    fds: dict[int, int] = {}
    results.put(("ready",))
    while True:
        task = tasks.get()
        if task is None:
            break
        epoch, batch_no, samples = task
        latencies: list[float] = []
        digest = nbytes = errors = 0
        for file_index, offset in samples:
            try:
                fd = fds.get(file_index)
                if fd is None:
                    fd = fds[file_index] = os.open(paths[file_index], os.O_RDONLY)
                began = time.perf_counter()
                data = os.pread(fd, sample_bytes, offset)
                latencies.append(time.perf_counter() - began)
            except OSError:
                errors += 1
                continue
            digest += sample_digest(data)
            nbytes += len(data)
        results.put((epoch, batch_no, nbytes, digest % DIGEST_MODULUS, latencies, errors))
    for fd in fds.values():
        os.close(fd)


# -- timeline -----------------------------------------------------------------------


class _Progress:
    """What the consumer has done so far; read by the timeline sampler thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0
        self.samples = 0
        self.bytes_read = 0
        self.compute_done_s = 0.0
        self.compute_started: float | None = None
        self.latencies_s: list[float] = []

    def compute_s(self, now: float) -> float:
        running = now - self.compute_started if self.compute_started is not None else 0.0
        return self.compute_done_s + running


class _Timeline:
    """Samples progress (and the mount's stats, if any) every interval, in a thread."""

    def __init__(self, progress: _Progress, interval_s: float, stats_fn: StatsFn | None) -> None:
        self.progress = progress
        self.interval_s = interval_s
        self.stats_fn = stats_fn
        self.points: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self._start = time.monotonic()
        self._previous = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.progress.lock:
            point = {
                "t_s": now - self._start,
                "epoch": self.progress.epoch,
                "samples": self.progress.samples,
                "bytes_read": self.progress.bytes_read,
                "compute_s": self.progress.compute_s(now),
                "latencies_s": self.progress.latencies_s,
            }
            self.progress.latencies_s = []
        stats = self._stats()
        point["block_hits"] = stats.get("block_hits") if stats else None
        point["block_misses"] = stats.get("block_misses") if stats else None
        point["fetched_bytes"] = stats.get("fetched_bytes") if stats else None
        return point

    def _stats(self) -> dict[str, Any] | None:
        if self.stats_fn is None:
            return None
        try:
            return self.stats_fn()
        except Exception as exc:  # stats are optional: a broken source must not stop the loader
            log.debug("stats unavailable: %s", exc)
            return None

    def _record(self) -> None:
        current = self._snapshot()
        self.points.append(_interval(self._previous, current))
        self._previous = current

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        self._record()
        return self.points


def _interval(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Rates over one timeline interval."""
    span_s = max(after["t_s"] - before["t_s"], 1e-9)
    millis = [value * 1000 for value in after["latencies_s"]]
    point: dict[str, Any] = {
        "t_s": round(after["t_s"], 3),
        "epoch": after["epoch"],
        "samples_per_s": (after["samples"] - before["samples"]) / span_s,
        "mb_per_s": (after["bytes_read"] - before["bytes_read"]) / span_s / 1e6,
        "busy_pct": 100 * (after["compute_s"] - before["compute_s"]) / span_s,
        "read_p50_ms": percentile(millis, 0.5) if millis else None,
        "read_p99_ms": percentile(millis, 0.99) if millis else None,
        "hit_ratio_pct": None,
        "fetched_mb_per_s": None,
    }
    if after["block_hits"] is not None and before["block_hits"] is not None:
        hits = after["block_hits"] - before["block_hits"]
        misses = after["block_misses"] - before["block_misses"]
        point["hit_ratio_pct"] = 100 * hits / (hits + misses) if hits + misses else None
        point["fetched_mb_per_s"] = (after["fetched_bytes"] - before["fetched_bytes"]) / span_s / 1e6
    return point


# -- the consumer ---------------------------------------------------------------------


class _Pool:
    """The worker processes and their queues."""

    def __init__(self, files: Sequence[FileEntry], config: LoaderConfig) -> None:
        context = multiprocessing.get_context("spawn")  # no inherited threads or locks
        self.tasks = context.Queue()
        self.results = context.Queue()
        paths = [entry.path for entry in files]
        self.processes = [
            context.Process(target=_worker, args=(paths, config.sample_bytes, self.tasks, self.results),
                            name=f"loader-{index}", daemon=True)
            for index in range(config.workers)
        ]
        for process in self.processes:
            process.start()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Block until every worker has started, so epoch 1 does not time interpreter start-up."""
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        ready = 0
        while ready < len(self.processes):
            try:
                message = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise RuntimeError(f"loader workers did not start within {WORKER_START_TIMEOUT_S:g} s") from None
            ready += message == ("ready",)

    def close(self) -> None:
        for _ in self.processes:
            self.tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def _run_epoch(pool: _Pool, epoch: int, samples: list[Sample], config: LoaderConfig,
               progress: _Progress) -> EpochResult:
    """Feed shuffled batches to the workers, consume them in order, compute on each."""
    order = list(samples)
    random.Random(config.seed * 1000 + epoch).shuffle(order)
    batches = [order[start : start + config.batch_size] for start in range(0, len(order), config.batch_size)]
    in_flight_max = config.workers * config.prefetch_batches
    arrived: dict[int, tuple[int, int, list[float], int]] = {}
    latencies: list[float] = []
    submitted = consumed = done_samples = nbytes = digest = errors = 0
    compute_s = stall_s = 0.0
    with progress.lock:
        progress.epoch = epoch
    start = time.monotonic()
    deadline = start + config.epoch_time_limit_s
    complete = True
    for batch_no, batch in enumerate(batches):
        while submitted < len(batches) and submitted - batch_no < in_flight_max:
            pool.tasks.put((epoch, submitted, batches[submitted]))
            submitted += 1
        waited_from = time.monotonic()
        if not _wait_for_batch(pool, epoch, batch_no, arrived, deadline, progress):
            complete = False
            break
        stall_s += time.monotonic() - waited_from
        batch_bytes, batch_digest, batch_latencies, batch_errors = arrived.pop(batch_no)
        consumed += 1
        nbytes += batch_bytes
        digest = (digest + batch_digest) % DIGEST_MODULUS
        errors += batch_errors
        latencies.extend(batch_latencies)
        if batch_errors < len(batch):  # nothing to train on when every read of the batch failed
            compute_s += _compute(config.compute_s, progress)
        done_samples += len(batch) - batch_errors
        with progress.lock:
            progress.samples += len(batch) - batch_errors
            progress.bytes_read += batch_bytes
        if time.monotonic() > deadline:
            complete = batch_no == len(batches) - 1
            break
    wall_s = time.monotonic() - start
    _drain(pool, epoch, submitted - consumed - len(arrived))
    millis = [value * 1000 for value in latencies]
    return EpochResult(epoch, done_samples, nbytes, wall_s, compute_s, stall_s,
                       percentile(millis, 0.5), percentile(millis, 0.99), digest, errors, complete)


def _wait_for_batch(pool: _Pool, epoch: int, batch_no: int, arrived: dict[int, Any], deadline: float,
                    progress: _Progress) -> bool:
    """Collect results until batch `batch_no` of `epoch` is in; False at the deadline."""
    while batch_no not in arrived:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            result_epoch, number, nbytes, digest, latencies, errors = pool.results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if result_epoch != epoch:
            continue  # left over from an epoch that was cut short
        arrived[number] = (nbytes, digest, latencies, errors)
        with progress.lock:
            progress.latencies_s.extend(latencies)
    return True


def _compute(compute_s: float, progress: _Progress) -> float:
    """The accelerator's work on one batch; returns the time it took."""
    began = time.monotonic()
    with progress.lock:
        progress.compute_started = began
    time.sleep(compute_s)
    elapsed = time.monotonic() - began
    with progress.lock:
        progress.compute_started = None
        progress.compute_done_s += elapsed
    return elapsed


def _drain(pool: _Pool, epoch: int, outstanding: int) -> None:
    """Wait (bounded) for `outstanding` batches still in flight, so the next epoch starts with idle workers."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while outstanding > 0 and time.monotonic() < deadline:
        try:
            result = pool.results.get(timeout=0.5)
        except queue.Empty:
            continue
        if result[0] == epoch:
            outstanding -= 1


def run_loader(files: Sequence[FileEntry], config: LoaderConfig, stats_fn: StatsFn | None = None) -> LoaderResult:
    """Run `config.epochs` epochs over the samples of `files`; stats_fn (e.g. a mount's counters) feeds the timeline."""
    samples = epoch_samples(files, config)
    if not samples:
        raise ValueError("no file holds a whole sample")
    pool = _Pool(files, config)
    progress = _Progress()
    timeline = _Timeline(progress, config.sample_interval_s, stats_fn)
    epochs: list[EpochResult] = []
    try:
        timeline.start()
        for epoch in range(1, config.epochs + 1):
            result = _run_epoch(pool, epoch, samples, config, progress)
            log.info("loader epoch %d: %d samples in %.1f s, %.0f samples/s, busy %.1f %%", epoch, result.samples,
                     result.wall_s, result.samples_per_s, result.busy_pct)
            epochs.append(result)
    finally:
        points = timeline.stop()
        pool.close()
    return LoaderResult(config, len(files), epochs, points)
