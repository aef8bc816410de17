"""Several mounts (tenants) of two hubs sharing one cache dir and one --cache-size (docs/shared-cache.md)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE, MiB
from hub_helpers import free_port, running_hub, wait_until
from mount_helpers import (
    SpokeMount,
    daemon_pid,
    read_uncached,
    run_cachefs,
    spoke_metrics,
    wait_for_stats,
)

from cachefs.cache.tenants import Ledger, TenantRecord

POOL = 8 * MiB
# The cyclic loader reads without read-ahead: each block it reads is one demand access, a hit or a miss;
# and through the daemon, which counts them (the kernel's direct reads of whole files would not be).
PLAIN_ARGS = (*SPOKE_ARGS, "--readahead-blocks", "0", "--prefetch-siblings", "0", "--no-passthrough")


def make_files(root: Path, count: int, size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    root.mkdir(parents=True)
    names = [f"part-{index:03d}.bin" for index in range(count)]
    for name in names:
        (root / name).write_bytes(rng.randbytes(size))
    return names


@contextmanager
def mounted(url: str, mountpoint: Path, cache_dir: Path, args: tuple[str, ...], tenant: str | None) -> Iterator[SpokeMount]:
    mountpoint.mkdir(exist_ok=True)
    own = cache_dir / "tenants" / tenant if tenant else cache_dir
    result = run_cachefs("mount", url, mountpoint, "--cache-dir", cache_dir, *args, "--cache-size", str(POOL),
                         *(("--tenant", tenant) if tenant else ()))
    spoke = SpokeMount(mountpoint, own, daemon_pid(own) if result.returncode == 0 else None)
    try:
        assert result.returncode == 0, f"{result.stderr}\nlog:\n{spoke.log_text()}"
        yield spoke
    finally:
        spoke.unmount()


def tenants_of(spoke: SpokeMount) -> dict[str, Any]:
    """Every tenant of the spoke's cache dir, as `cachefs stats --json` shows them."""
    result = run_cachefs("stats", "--json", spoke.mountpoint)
    assert result.returncode == 0, result.stderr
    tenants: dict[str, Any] = json.loads(result.stdout)["tenants"]
    return tenants


class Sampler:
    """Samples the tenants' cached bytes (each daemon's own accounting) while a test runs."""

    def __init__(self, spokes: list[SpokeMount]) -> None:
        self._spokes = spokes
        self.peak_total = 0
        self.peaks = [0] * len(spokes)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._done.is_set():
            used = [spoke.stats()["cached_bytes"] for spoke in self._spokes]
            self.peaks = [max(peak, value) for peak, value in zip(self.peaks, used, strict=True)]
            self.peak_total = max(self.peak_total, sum(used))
            self._done.wait(0.01)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def published(directory: Path) -> TenantRecord:
    record = Ledger.read(directory)
    assert record is not None
    return record


def scan(spoke: SpokeMount, root: Path, names: list[str], passes: int, min_seconds: float = 0.0) -> None:
    """Read every file `passes` times, and on until `min_seconds` have passed."""
    deadline = time.monotonic() + min_seconds
    done = 0
    while done < passes or time.monotonic() < deadline:
        for name in names:
            assert read_uncached(spoke.mountpoint / name) == (root / name).read_bytes(), name
        done += 1


def test_a_cyclic_loader_within_its_minimum_keeps_its_hits_while_another_tenant_scans(tmp_path: Path) -> None:
    cyclic_root, scan_root = tmp_path / "cyclic-data", tmp_path / "scan-data"
    cyclic_names = make_files(cyclic_root, 6, 512 * 1024, seed=1)  # 3 MiB, within its 4 MiB minimum
    scan_names = make_files(scan_root, 24, 1 * MiB, seed=2)  # 3 x the cache
    cache_dir = tmp_path / "cache"
    with ExitStack() as stack:
        cyclic_hub = stack.enter_context(running_hub(cyclic_root))
        scan_hub = stack.enter_context(running_hub(scan_root))
        # The cyclic loader is the cache dir's default tenant (its files where a single mount keeps them).
        cyclic = stack.enter_context(
            mounted(cyclic_hub.url, tmp_path / "cyclic", cache_dir, (*PLAIN_ARGS, "--cache-min", "4M"), None)
        )
        port = free_port()
        scanner = stack.enter_context(mounted(scan_hub.url, tmp_path / "scan", cache_dir,
                                              (*SPOKE_ARGS, "--metrics-listen", f"127.0.0.1:{port}"), "scan"))
        scan(cyclic, cyclic_root, cyclic_names, 1)  # its warm-up epoch
        wait_for_stats(cyclic, lambda s: s["cached_bytes"] == 3 * MiB)
        before = cyclic.stats()
        # For some seconds too: a scanner's allowance grows at the tenants' refresh (every second) once it
        # turns blocks away, so a scan over in a second or two would not show what it may use.
        scanning = threading.Thread(target=scan, args=(scanner, scan_root, scan_names, 3, 8.0))
        epochs = 0
        with Sampler([cyclic, scanner]) as sampler:
            scanning.start()
            while scanning.is_alive() or epochs < 2:
                scan(cyclic, cyclic_root, cyclic_names, 1)
                epochs += 1
                time.sleep(1.0)  # a loader that reads far less than the scanner: its minimum, not its use, keeps its blocks
            scanning.join()
        after = cyclic.stats()
        hits, misses = after["block_hits"] - before["block_hits"], after["block_misses"] - before["block_misses"]
        assert hits + misses >= 2 * 3 * MiB // TEST_BLOCK_SIZE
        assert hits / (hits + misses) >= 0.95, (hits, misses, epochs)
        assert after["cached_bytes"] == 3 * MiB
        assert sampler.peaks[1] >= POOL - 4 * MiB - 4 * TEST_BLOCK_SIZE  # the scanner used what the minimum leaves
        assert sampler.peak_total <= POOL, sampler.peak_total
        assert scanner.stats()["fetched_bytes"] >= len(scan_names) * MiB  # it really scanned

        # Both tenants, as `cachefs stats` of either mount shows them (root, or the daemon's owner,
        # through the control socket), not the stats attribute that every user of a mount may read.
        assert "tenants" not in scanner.stats()
        shown = tenants_of(scanner)
        by_name = {tenant["name"]: tenant for tenant in shown["tenants"]}
        assert set(by_name) == {"default", "scan"} and all(tenant["live"] for tenant in shown["tenants"])
        assert by_name["default"]["min_bytes"] == 4 * MiB and by_name["default"]["allowance_bytes"] >= 4 * MiB
        assert by_name["scan"]["fetched_bytes"] == scanner.stats()["fetched_bytes"]  # its own, as counted now
        assert wait_until(lambda: published(cache_dir).block_hits == after["block_hits"], 5)  # within a refresh
        metrics = spoke_metrics(port)  # every tenant, from the scanner's daemon
        assert metrics['cachefs_tenant_min_bytes{tenant="default"}'] == 4 * MiB
        assert metrics['cachefs_tenant_used_bytes{tenant="default"}'] == 3 * MiB
        assert metrics['cachefs_tenant_block_hits_total{tenant="default"}'] == after["block_hits"]
        assert metrics['cachefs_tenant_fetched_bytes_total{tenant="scan"}'] == scanner.stats()["fetched_bytes"]
        assert metrics['cachefs_tenant_mounted{tenant="scan"}'] == 1
        text = run_cachefs("stats", cyclic.mountpoint).stdout
        assert "default: allowed 4.0 MiB of the shared 8.0 MiB" in text, text
        rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("default ", "scan "))}
        assert set(rows) == {"default", "scan"} and rows["default"][1] == "yes"


def test_an_idle_tenant_without_a_minimum_gives_the_whole_cache_to_a_scanner(tmp_path: Path) -> None:
    idle_root, scan_root = tmp_path / "idle-data", tmp_path / "scan-data"
    idle_names = make_files(idle_root, 6, 512 * 1024, seed=3)
    scan_names = make_files(scan_root, 24, 1 * MiB, seed=4)
    cache_dir = tmp_path / "cache"
    with ExitStack() as stack:
        idle_hub = stack.enter_context(running_hub(idle_root))
        scan_hub = stack.enter_context(running_hub(scan_root))
        idle = stack.enter_context(mounted(idle_hub.url, tmp_path / "idle", cache_dir, PLAIN_ARGS, "idle"))
        scanner = stack.enter_context(mounted(scan_hub.url, tmp_path / "scan", cache_dir, SPOKE_ARGS, "scan"))
        scan(idle, idle_root, idle_names, 1)
        wait_for_stats(idle, lambda s: s["cached_bytes"] == 3 * MiB)
        with Sampler([idle, scanner]) as sampler:
            deadline = time.monotonic() + 60
            # The idle tenant's recent use fades within seconds; the scanner's allowance grows as it does.
            while sampler.peaks[1] < POOL - 8 * TEST_BLOCK_SIZE:
                assert time.monotonic() < deadline, (sampler.peaks, tenants_of(scanner))
                scan(scanner, scan_root, scan_names, 1)
        assert sampler.peak_total <= POOL, sampler.peak_total
        assert idle.stats()["cached_bytes"] <= 8 * TEST_BLOCK_SIZE
        scan(idle, idle_root, idle_names, 1)  # and evicted blocks are fetched again, right


def test_a_second_mount_of_a_tenant_is_refused_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "data"
    make_files(root, 2, 256 * 1024, seed=5)
    cache_dir = tmp_path / "cache"
    with running_hub(root) as hub, mounted(hub.url, tmp_path / "first", cache_dir, SPOKE_ARGS, "jobs") as first:
        (tmp_path / "second").mkdir()
        for extra, message in [
            (("--tenant", "jobs"), f"cache dir {cache_dir} is in use by another cachefs daemon (pid {first.pid}) as "
                                   "tenant 'jobs': give each mount sharing it its own --tenant"),
            (("--tenant", "other", "--cache-min", "9M", "--cache-size", "16M"),
             f"cache dir {cache_dir} is shared with tenant 'jobs', mounted with --cache-size 8.0 MiB: "
             "mount with the same --cache-size"),
            (("--tenant", "bad/name"), "invalid --tenant 'bad/name': 1 to 32 letters, digits, '.', '_' or '-', "
                                       "starting with a letter or digit"),
        ]:
            result = run_cachefs("mount", hub.url, tmp_path / "second", "--cache-dir", cache_dir, *SPOKE_ARGS,
                                 "--cache-size", str(POOL), *extra)
            assert result.returncode != 0
            assert result.stderr.strip() == f"cachefs: error: {message}", result.stderr
        with mounted(hub.url, tmp_path / "second", cache_dir, (*SPOKE_ARGS, "--cache-min", "3M"), "other"):
            (tmp_path / "third").mkdir()
            result = run_cachefs("mount", hub.url, tmp_path / "third", "--cache-dir", cache_dir, *SPOKE_ARGS,
                                 "--cache-size", str(POOL), "--tenant", "third", "--cache-min", "6M")
            assert result.returncode != 0
            assert result.stderr.strip() == (f"cachefs: error: --cache-min 6.0 MiB does not fit: the other tenants of "
                                             f"{cache_dir} are guaranteed 3.0 MiB of its 8.0 MiB (mounted ones' "
                                             f"minimums, and pins)"), result.stderr


def test_a_cache_dir_of_one_mount_made_before_tenants_keeps_its_blocks_and_counts_for_new_tenants(tmp_path: Path) -> None:
    root = tmp_path / "data"
    names = make_files(root, 4, 1 * MiB, seed=6)
    cache_dir = tmp_path / "cache"
    with running_hub(root) as hub:
        with mounted(hub.url, tmp_path / "old", cache_dir, PLAIN_ARGS, None) as old:
            scan(old, root, names, 1)
            wait_for_stats(old, lambda s: s["cached_bytes"] == 4 * MiB)
        # A cache dir made before tenants is laid out as the default tenant's, without its record.
        (cache_dir / "tenant.record").unlink()
        # A new tenant counts the unmounted default tenant's bytes before growing into them.
        with mounted(hub.url, tmp_path / "new", cache_dir, PLAIN_ARGS, "new") as new:
            assert wait_until(lambda: (cache_dir / "tenant.record").exists(), 10)
            shown = {t["name"]: t for t in tenants_of(new)["tenants"]}
            assert shown["default"]["used_bytes"] == 4 * MiB and not shown["default"]["live"]
        # The default tenant mounts as before and finds its blocks.
        with mounted(hub.url, tmp_path / "again", cache_dir, PLAIN_ARGS, None) as again:
            scan(again, root, names, 1)
            stats = again.stats()
            assert stats["fetched_bytes"] == 0 and stats["block_misses"] == 0
