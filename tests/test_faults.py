"""Fault injection: broken responses, a hub that goes away, corrupted cache files, SIGKILL.

Whatever happens, a read returns the source's bytes or fails cleanly
(EIO/ESTALE) within its bound: never wrong bytes, never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE, source_files
from fault_proxy import running_fault_proxy
from hub_helpers import running_hub
from mount_helpers import (
    SpokeMount,
    cache_data_files,
    cache_disk_bytes,
    daemon_pid,
    is_mounted,
    mounted_spoke,
    read_uncached,
    run_cachefs,
)

from cachefs.errors import (
    FetchAbandoned,
    HubError,
    HubProtocolError,
    HubStatusError,
    HubUnavailable,
    RemoteFileChanged,
)
from cachefs.fs import failed_reads
from cachefs.processes import wait_for_pid

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 20.0
STRESS_SECONDS = 20.0
# The stated bound of a read that needs the hub: --fetch-timeout plus this
# margin (cachefs mount --help, README).
BOUND_MARGIN_S = 1.0
OUTAGE_FETCH_TIMEOUT_S = 5.0


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads = self.errors = self.mismatches = 0
        self.slowest_s = 0.0  # the slowest single read call
        self.problems: list[str] = []

    def record(self, seconds: float, ok: bool | None, what: str) -> None:
        with self.lock:
            self.reads += 1
            self.slowest_s = max(self.slowest_s, seconds)
            if ok is None:
                self.errors += 1
            elif not ok:
                self.mismatches += 1
                self.problems.append(what)


CLEAN_ERRORS = (errno.EIO, errno.ESTALE)
# When the daemon itself is killed, reads in flight end with the kernel's own answers.
DAEMON_GONE_ERRORS = (*CLEAN_ERRORS, errno.ECONNABORTED, errno.ENOTCONN)


def mixed_reader(
    spoke: SpokeMount, dataset: Path, files: list[Path], seed: int, stop: threading.Event, tally: Tally,
    allowed_errors: tuple[int, ...] = CLEAN_ERRORS,
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        relative = rng.choice(files)
        source = (dataset / relative).read_bytes()
        pattern = rng.choice(["whole", "range", "range", "tail"])
        if pattern == "whole" or not source:
            offset, length = 0, len(source)
        elif pattern == "tail":
            offset, length = max(0, len(source) - rng.randrange(1, 3 * TEST_BLOCK_SIZE)), 4 * TEST_BLOCK_SIZE
        else:
            offset, length = rng.randrange(len(source)), rng.randrange(1, 300_000)
        timings: list[float] = []
        try:
            got = read_uncached(spoke.mountpoint / relative, offset, length, timings)
            ok: bool | None = got == source[offset : offset + length]
        except OSError as exc:
            if exc.errno not in allowed_errors:
                tally.record(0.0, False, f"{relative}: unexpected {exc!r}")
                continue
            ok = None
        tally.record(max(timings, default=0.0), ok, f"{relative} {offset}+{length}")


def flip_cached_bits(cache_dir: Path, stop: threading.Event, flips: list[int]) -> None:
    rng = random.Random(99)
    while not stop.wait(0.5):
        blocks = cache_data_files(cache_dir)
        if not blocks:
            continue
        victim = rng.choice(blocks)
        try:
            with open(victim, "r+b") as block:
                size = os.fstat(block.fileno()).st_size
                if size:
                    position = rng.randrange(size)
                    block.seek(position)
                    byte = block.read(1)
                    block.seek(position)
                    block.write(bytes([byte[0] ^ 0x10]))
                    flips.append(1)
        except FileNotFoundError:
            pass  # evicted meanwhile


def test_stress_through_injected_faults(dataset: Path, tmp_path: Path) -> None:
    files = source_files(dataset)
    tally = Tally()
    flips: list[int] = []
    with running_hub(dataset) as hub, running_fault_proxy(hub.url, fault_rate=0.25, stall_s=1.0) as proxy:
        port = hub.port
        # Bits flipped in the cache are caught by the daemon's check of every read: --no-passthrough (the
        # kernel's direct reads are covered by re-verification instead, test_passthrough.py).
        args = (*SPOKE_ARGS, "--fetch-timeout", str(FETCH_TIMEOUT_S), "--cache-size", str(40 * TEST_BLOCK_SIZE),
                "--no-passthrough")
        with mounted_spoke(proxy.url, tmp_path, args) as spoke:
            stop = threading.Event()
            workers = [
                threading.Thread(target=mixed_reader, args=(spoke, dataset, files, seed, stop, tally)) for seed in range(8)
            ]
            workers.append(threading.Thread(target=flip_cached_bits, args=(spoke.cache_dir, stop, flips)))
            for worker in workers:
                worker.start()
            time.sleep(STRESS_SECONDS / 2)
            hub.stop()  # the hub restarts in the middle of it all
            time.sleep(2)
            with running_hub(dataset, ["--listen", f"127.0.0.1:{port}"]):
                time.sleep(STRESS_SECONDS / 2)
                stop.set()
                for worker in workers:
                    worker.join(timeout=FETCH_TIMEOUT_S + 30)
                assert not any(worker.is_alive() for worker in workers), "a reader hung"
                stats = spoke.stats()
    faults = dict(proxy.counts)
    log.warning("stress: %d reads, %d errors returned, %d mismatches, slowest %.1f s, faults %s, "
                "cache bit flips %d, stats %s", tally.reads, tally.errors, tally.mismatches, tally.slowest_s, faults,
                len(flips), {k: stats[k] for k in ("integrity_failures", "corrupt_blocks", "fetch_retries", "fetch_failures")})
    assert tally.mismatches == 0, tally.problems[:5]
    assert tally.reads > 100
    assert tally.slowest_s < FETCH_TIMEOUT_S + 15
    assert all(faults.get(kind, 0) > 0 for kind in ("error", "drop", "truncate", "flip", "stall")), faults
    assert stats["integrity_failures"] > 0  # flipped bits on the wire were caught
    assert stats["fetch_retries"] > 0
    assert tally.errors <= tally.reads // 10, (tally.errors, tally.reads)  # retries absorb nearly all faults


def test_hub_down_fails_within_bound_and_recovers_without_remount(dataset: Path, tmp_path: Path) -> None:
    with running_hub(dataset) as hub:
        port = hub.port
        with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--fetch-timeout", "2")) as spoke:
            cached = "shards/shard-003.bin"
            assert read_uncached(spoke.mountpoint / cached) == (dataset / cached).read_bytes()
            hub.stop()
            assert read_uncached(spoke.mountpoint / cached) == (dataset / cached).read_bytes()
            started = time.monotonic()
            try:
                read_uncached(spoke.mountpoint / "shards/shard-001.bin", 0, 100)
                raise AssertionError("an uncached read succeeded with the hub down")
            except OSError as exc:
                assert exc.errno == errno.EIO
            assert time.monotonic() - started < 2 + BOUND_MARGIN_S
            shown = run_cachefs("stats", spoke.mountpoint).stdout
            assert any(line.split()[:3] == ["hub", "errors", "connection"] for line in shown.splitlines()), shown
            time.sleep(failed_reads.FRESH_S)  # a hub back sooner finds that read's blocks failing at once
            with running_hub(dataset, ["--listen", f"127.0.0.1:{port}"]):
                relative = "shards/shard-001.bin"
                assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
            # And unmounting works while the hub is down.
            started = time.monotonic()
            result = run_cachefs("unmount", spoke.mountpoint)
            assert result.returncode == 0, result.stderr
            assert time.monotonic() - started < 15
            assert not is_mounted(spoke.mountpoint)


@pytest.mark.parametrize("fault", ["error", "truncate"])
def test_a_hub_answering_only_errors_fails_a_read_within_the_bound(dataset: Path, tmp_path: Path, fault: str) -> None:
    """Every data request gets a 503 (or a body cut short): one read() of an uncached file
    fails within --fetch-timeout and a second, though the kernel asks twice (its read-ahead
    request, then the page its reader wants)."""
    with running_hub(dataset) as hub, running_fault_proxy(hub.url, fault_rate=1.0, faults=(fault,)) as proxy:
        with mounted_spoke(proxy.url, tmp_path, (*SPOKE_ARGS, "--fetch-timeout", "2")) as spoke:
            started = time.monotonic()
            with open(spoke.mountpoint / "shards/shard-001.bin", "rb", buffering=0) as uncached:
                with pytest.raises(OSError) as failed:
                    os.pread(uncached.fileno(), 4096, 0)
            assert failed.value.errno == errno.EIO
            assert time.monotonic() - started < 2 + BOUND_MARGIN_S


def test_sigkill_in_the_middle_of_filling_leaves_a_consistent_cache(dataset: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    files = source_files(dataset)
    with running_hub(dataset) as hub:
        with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir) as spoke:
            stop = threading.Event()
            tally = Tally()
            readers = [threading.Thread(target=mixed_reader, args=(spoke, dataset, files, s, stop, tally, DAEMON_GONE_ERRORS))
                       for s in range(4)]
            for reader in readers:
                reader.start()
            time.sleep(1.5)
            assert spoke.pid is not None
            os.kill(spoke.pid, signal.SIGKILL)
            stop.set()
            for reader in readers:
                reader.join(timeout=30)
            assert tally.mismatches == 0
            assert wait_for_pid(spoke.pid, 30), f"daemon {spoke.pid} survived SIGKILL"
            result = run_cachefs("mount", hub.url, spoke.mountpoint, "--cache-dir", cache_dir, *SPOKE_ARGS)
            assert result.returncode == 0, result.stderr
            spoke.pid = daemon_pid(cache_dir)
            for relative in files:
                assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes(), relative
            stats = spoke.stats()
            assert stats["corrupt_blocks"] == 0  # no torn block was ever indexed
            assert cache_disk_bytes(cache_dir) >= stats["cached_bytes"]
            deadline = time.monotonic() + 20  # the mount after a crash sweeps the cache in the background
            while "did not end cleanly" not in spoke.log_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "did not end cleanly" in spoke.log_text()


def timed_failure(read: Callable[[], object]) -> tuple[float, int | None]:
    """Seconds from the call to its end, and the errno it failed with (None: it succeeded)."""
    started = time.monotonic()
    try:
        read()
    except OSError as exc:
        return time.monotonic() - started, exc.errno
    return time.monotonic() - started, None


def pread_at(path: Path, length: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def cat(path: Path) -> None:
    result = subprocess.run(["cat", str(path)], capture_output=True, timeout=120)
    if result.returncode != 0:
        raise OSError(errno.EIO if b"Input/output error" in result.stderr else None, result.stderr.decode())


@pytest.mark.parametrize("outage", ["paused", "killed"])
def test_a_read_with_the_hub_down_fails_within_the_fetch_timeout(tmp_path: Path, outage: str) -> None:
    """From read() to EIO within --fetch-timeout plus the margin, however many requests the kernel
    makes of it (after a failed read-ahead request it asks again for the reader's page) or queues
    (read-ahead); cached files keep serving, and the same reads succeed once the hub is back."""
    root = tmp_path / "data"
    root.mkdir()
    rng = random.Random(30)
    for name in ("cached.bin", "a.bin", "b.bin", "c.bin"):
        (root / name).write_bytes(rng.randbytes(8 << 20))
    args = ("--block-size", "1M", "--fetch-timeout", str(OUTAGE_FETCH_TIMEOUT_S))
    reads: dict[str, Callable[[Path], object]] = {
        "pread 4 KiB": lambda mnt: pread_at(mnt / "a.bin", 4096, 3 << 20),
        "pread 1 MiB": lambda mnt: pread_at(mnt / "b.bin", 1 << 20, (2 << 20) + 4096),
        "cat": lambda mnt: cat(mnt / "c.bin"),
    }
    with running_hub(root) as hub:
        port = hub.port
        with mounted_spoke(hub.url, tmp_path, args) as spoke:
            assert (spoke.mountpoint / "cached.bin").read_bytes() == (root / "cached.bin").read_bytes()
            if outage == "paused":
                hub.proc.send_signal(signal.SIGSTOP)
            else:
                hub.stop()
            try:
                outcomes: dict[str, tuple[float, int | None]] = {}
                started = time.monotonic()
                threads = [threading.Thread(target=lambda name=name, read=read: outcomes.__setitem__(
                    name, timed_failure(lambda: read(spoke.mountpoint)))) for name, read in reads.items()]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(timeout=120)
                assert read_uncached(spoke.mountpoint / "cached.bin") == (root / "cached.bin").read_bytes()
            finally:
                if outage == "paused":
                    hub.proc.send_signal(signal.SIGCONT)
            log.warning("hub %s, --fetch-timeout %g: %s", outage, OUTAGE_FETCH_TIMEOUT_S,
                        {name: f"{seconds:.2f} s, errno {code}" for name, (seconds, code) in outcomes.items()})
            assert {name: code for name, (_, code) in outcomes.items()} == dict.fromkeys(reads, errno.EIO)
            slow = {name: seconds for name, (seconds, _) in outcomes.items()
                    if seconds > OUTAGE_FETCH_TIMEOUT_S + BOUND_MARGIN_S}
            assert not slow, slow
            # Back once every read of the outage has failed (the kernel's read-ahead requests too)
            # and was forgotten: a read of blocks whose read just failed, with the hub silent
            # since, fails at once.
            outage_forgotten = started + OUTAGE_FETCH_TIMEOUT_S + BOUND_MARGIN_S + failed_reads.FRESH_S
            time.sleep(max(0.0, outage_forgotten - time.monotonic()))
            with contextlib.ExitStack() as restarted:
                if outage == "killed":
                    restarted.enter_context(running_hub(root, ["--listen", f"127.0.0.1:{port}"]))
                assert read_uncached(spoke.mountpoint / "c.bin") == (root / "c.bin").read_bytes()
                assert pread_at(spoke.mountpoint / "a.bin", 4096, 3 << 20) == (root / "a.bin").read_bytes()[3 << 20:][:4096]


F, V, OTHER_V = b"f" * 8, b"v" * 8, b"w" * 8


def test_a_read_of_blocks_whose_read_just_failed_with_the_hub_silent_fails_at_once() -> None:
    answers = [0]
    silence = failed_reads.FailedReads(lambda: answers[0])
    silence.read_failed(F, V, range(0, 2), HubUnavailable("hub did not deliver block 1 within 5 s"), 0, 10.0)
    failed = silence.failure(F, V, range(1, 3), 10.01)
    assert isinstance(failed, HubUnavailable) and "hub did not deliver block 1 within 5 s" in str(failed)
    assert silence.failure(F, V, range(2, 3), 10.01) is None  # other blocks
    assert silence.failure(F, OTHER_V, range(0, 1), 10.01) is None  # another version
    assert silence.failure(F, V, range(0, 1), 10.0 + failed_reads.FRESH_S) is None  # forgotten
    assert silence.failure(F, V, range(0, 1), 9.9) is None  # a read already waiting when it failed
    answers[0] = 1
    assert silence.failure(F, V, range(0, 1), 10.01) is None  # the hub answered since


@pytest.mark.parametrize("error, began, answers, remembered", [
    (HubUnavailable("hub sent nothing for 15 s"), 3, 4, True),  # a slow hub: retried until the timeout already
    (HubStatusError(503, "hub answered 503"), 3, 4, True),
    (HubProtocolError("block 2 failed its checksum"), 3, 4, True),
    (RemoteFileChanged("file changed on the hub (412)"), 3, 3, False),  # ESTALE, at once anyway
    (FetchAbandoned("fetch was cancelled"), 3, 3, False),  # its reader went away: no failure of the hub
])
def test_a_read_that_failed_whatever_the_hub_answered_fails_its_retry_at_once(
    error: HubError, began: int, answers: int, remembered: bool
) -> None:
    """Not only for a silent hub: one that answers errors, cuts bodies short or is too slow had
    its fetch retried until the fetch timeout, and the kernel's retry must not wait another."""
    silence = failed_reads.FailedReads(lambda: answers)
    silence.read_failed(F, V, range(0, 1), error, began, 10.0)
    failed = silence.failure(F, V, range(0, 1), 10.01)
    assert (failed is not None) == remembered
    assert failed is None or str(error) in str(failed)
    assert silence.failure(F, V, range(0, 1), 10.0 + failed_reads.FRESH_S) is None


def test_failed_reads_remembered_are_bounded() -> None:
    silence = failed_reads.FailedReads(lambda: 0, max_blocks=4)
    silence.read_failed(F, V, range(0, 10), HubUnavailable("cannot connect"), 0, 10.0)
    assert [silence.failure(F, V, range(n, n + 1), 10.01) is not None for n in range(10)] == [False] * 6 + [True] * 4
