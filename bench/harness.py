"""The side-by-side benchmark: local disk, cachefs and its peers, cold and warm, over an emulated WAN.

For each system and link the run is: mount with an empty cache, drop the
page cache, run `cachefs bench MOUNT` (cold), unmount; mount again on the
same cache dir, drop the page cache, run it again (warm), unmount. Each
scenario gets its own WAN emulator, whose exit line counts the bytes that
crossed the link. The daemon's CPU time and peak RSS come from /proc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cachefs.bench import report
from cachefs.bench.cli import FULL, QUICK, Budget
from cachefs.bench.memory import peak_rss_kib
from cachefs.bench.workloads import can_drop_page_cache, drop_page_cache, find_dataset, sequential_read, small_read_all

from .processes import (
    CachefsMount,
    PeerMount,
    Server,
    cpu_seconds,
    main_thread_cpu_seconds,
    python_command,
    start_server,
    wan_bytes_from_summary,
)
from .side_by_side import alternate
from .targets import CHECKED_STATE

log = logging.getLogger(__name__)

RTT_MS = 60.0
LINK_MBIT = 1000.0
PEERS = ("rclone", "httpdirfs")
# Slack on top of a scenario's workload time limits: mount-free start-up, walks, draining.
SCENARIO_SLACK_S = 120.0


@dataclasses.dataclass(frozen=True)
class Link:
    """How a spoke reaches its server: through the emulator, or directly on loopback."""

    key: str
    label: str
    delay_ms: float | None  # one way; None: no emulator
    rate_mbit: float | None

    @property
    def rate_mb_per_s(self) -> float | None:
        return self.rate_mbit / 8 if self.rate_mbit else None


# By default the kernel reads verified cached files directly (FUSE passthrough,
# docs/usage.md). On this link every cached file is first read whole and verified
# before the warm run, and one more warm run measures the daemon's checked path
# (--no-passthrough): warm reads fetch nothing, so one link shows both.
CHECKED_LINK = "capped"
CHECKED_ARGS = ("--no-passthrough",)
VERIFY_TIMEOUT_S = 120.0

LINKS = {
    "capped": Link("capped", f"{RTT_MS:g} ms, {LINK_MBIT / 1000:g} Gbit/s", RTT_MS / 2, LINK_MBIT),
    "uncapped": Link("uncapped", f"{RTT_MS:g} ms, uncapped", RTT_MS / 2, None),
    "direct": Link("direct", "direct, no WAN", None, None),
}


@dataclasses.dataclass
class RunConfig:
    """Everything `python -m bench` was asked to do."""

    data_dir: Path
    work_dir: Path
    results_dir: Path
    quick: bool
    systems: Sequence[str]
    links: Sequence[str]
    peer_links: Sequence[str]
    spoke_args: Sequence[str]
    bench_args: Sequence[str]  # passed to every `cachefs bench`
    cache_size_bytes: int

    @property
    def budget(self) -> Budget:
        return QUICK if self.quick else FULL


@dataclasses.dataclass
class Scenario:
    """One measured configuration."""

    system: str  # local, cachefs, rclone, httpdirfs
    link: Link | None
    state: str  # cold, warm, or "" for local

    @property
    def name(self) -> str:
        if self.link is None:
            return "local disk"
        return f"{self.system}, {self.link.label}, {self.state}"

    @property
    def slug(self) -> str:
        parts = (self.system, self.link.key if self.link else "", self.state)
        return re.sub(r"[^a-z0-9]+", "-", "-".join(part for part in parts if part).lower()).strip("-")


def scenario_timeout_s(budget: Budget) -> float:
    """The bound on one `cachefs bench` run."""
    return 4 * budget.time_limit_s + 2 * budget.random_time_limit_s + 2 * budget.loader_epoch_time_limit_s \
        + SCENARIO_SLACK_S


# -- running `cachefs bench` ----------------------------------------------------------------


def run_workloads(path: Path, scenario: Scenario, config: RunConfig, extra_args: Sequence[str]) -> dict[str, Any]:
    """`cachefs bench PATH --json ...` in its own process group, killed if it overruns."""
    out = config.work_dir / "json" / f"{scenario.slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # The page cache dropped before every phase, not only the scenario's first: on a VM whose balloon
    # reports free memory to the host, a phase that finds the page cache full pays a host fault for
    # every fresh page it fills, twice the kernel time of the same phase started after a drop.
    drop = ["--drop-caches"] if can_drop_page_cache() else []
    argv = python_command("-m", "cachefs", "bench", path, "--json", out, "--label", scenario.name, "-v", *drop,
                          *(["--quick"] if config.quick else []), *config.bench_args, *extra_args)
    log_path = config.work_dir / "logs" / f"{scenario.slug}.bench.log"
    timeout_s = scenario_timeout_s(config.budget)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                                start_new_session=True)
    try:
        returncode = proc.wait(timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise
    if returncode != 0:
        raise RuntimeError(f"cachefs bench exited {returncode}; see {log_path}")
    return without_scratch_paths(json.loads(out.read_text()))


# Where a run's mounts, caches and dataset were: scratch paths, which the command line already names.
SCRATCH_KEYS = ("path",)
STATS_SCRATCH_KEYS = ("cache_dir", "mountpoint")


def without_scratch_paths(results: dict[str, Any]) -> dict[str, Any]:
    """`cachefs bench`'s results without the paths it ran on, which would only name this run's temp dirs."""
    kept = {key: value for key, value in results.items() if key not in SCRATCH_KEYS}
    for key in ("stats_before", "stats_after"):
        if isinstance(kept.get(key), dict):
            kept[key] = {name: value for name, value in kept[key].items() if name not in STATS_SCRATCH_KEYS}
    return kept


def warm_caps(cold: dict[str, Any] | None) -> list[str]:
    """Arguments that make a warm run read only what its cold run read, where the cold one was cut short.

    The random-read group needs none: it is prewarmed whole between the runs (see `Bench.prewarm`).
    """
    small_files = small_files_read(cold)
    return [] if small_files is None else ["--small-files", str(small_files)]


def small_files_read(cold: dict[str, Any] | None) -> int | None:
    """How many small files a cold run read, if its read was cut short (else None: all of them)."""
    small = cold["workloads"].get("small", {}) if cold else {}
    if "files" in small and not small.get("complete", True):
        return max(1, small["files"])
    return None


def bytes_read(results: dict[str, Any]) -> int:
    """Everything the workloads read through the filesystem."""
    return sum(report.workload_bytes_read(result) for result in results["workloads"].values())


# -- one scenario -----------------------------------------------------------------------------


class Bench:
    """Runs the scenarios; every process it starts is on `self.stack`, so leaving it cleans up."""

    def __init__(self, config: RunConfig, stack: contextlib.ExitStack) -> None:
        self.config = config
        self.stack = stack
        self.logs = config.work_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.scenarios: list[dict[str, Any]] = []
        self.prewarms: list[dict[str, Any]] = []

    # servers

    def start_hub(self) -> Server:
        argv = python_command("-m", "hubserver", "serve", "--root", self.config.data_dir, "--listen", "127.0.0.1:0")
        hub = start_server("hub", argv, "cachefs-hub listening on ", self.logs / "hub.log", timeout_s=120)
        self.stack.callback(hub.stop)
        return hub

    def start_static(self) -> Server:
        argv = python_command("-m", "bench.static_server", "--root", self.config.data_dir,
                              "--listen", "127.0.0.1:0")
        static = start_server("static", argv, "static listening on ", self.logs / "static.log")
        self.stack.callback(static.stop)
        return static

    @contextlib.contextmanager
    def link_to(self, server: Server, link: Link, slug: str, port: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
        """The URL to reach `server` over `link` (on `port`, 0: any); on exit `wan["bytes"]` holds what crossed it.

        A warm run listens on its cold run's port: rclone and httpdirfs key their caches by URL.
        """
        wan: dict[str, Any] = {"bytes": None, "port": None, "cpu_s": None}
        if link.delay_ms is None:
            yield server.url, wan
            return
        argv = python_command("-m", "bench.wan", "--target", server.hostport, "--listen", f"127.0.0.1:{port}",
                              "--delay-ms", f"{link.delay_ms:g}",
                              *(["--rate-mbit", f"{link.rate_mbit:g}"] if link.rate_mbit else []))
        emulator = start_server("wan", argv, "wan listening on ", self.logs / f"{slug}.wan.log")
        wan["port"] = int(emulator.url.rpartition(":")[2])
        cpu_at_start_s = cpu_seconds(emulator.proc.pid)
        try:
            yield emulator.url, wan
        finally:
            cpu_at_end_s = cpu_seconds(emulator.proc.pid)
            if cpu_at_start_s is not None and cpu_at_end_s is not None:
                wan["cpu_s"] = cpu_at_end_s - cpu_at_start_s
            wan["bytes"] = wan_bytes_from_summary(emulator.stop())

    def calibrate(self, server: Server, link: Link, files: Sequence[Path], streams: int) -> dict[str, Any]:
        """Plain HTTP GETs (curl) through `link`, `streams` at once: what the link and emulator carry on
        this machine for as many connections as a sequential workload has readers. Each stream
        fetches its share of `files` one after the other over one connection, as a reader goes
        from file to file.

        The page cache is dropped first, as before every cold phase: the server then reads
        the files from disk, as the hub does for the spoke, not from memory an earlier
        calibration filled."""
        record: dict[str, Any] = {"link": link.key, "label": link.label, "streams": streams}
        if not shutil.which("curl"):
            return {**record, "error": "curl not installed"}
        if not 1 <= streams <= len(files):
            raise ValueError(f"{streams} curl streams need at least as many files, got {len(files)}")
        paths = [str(path.relative_to(self.config.data_dir)) for path in files]
        record["page_cache_dropped"] = can_drop_page_cache() and drop_page_cache(names_too=False)
        with self.link_to(server, link, f"calibrate-{link.key}-{streams}") as (url, wan):
            began = time.monotonic()
            procs = [subprocess.Popen(["curl", "-s", "-f", "--max-time", "120",
                                       *(arg for path in paths[index::streams] for arg in ("-o", "/dev/null", f"{url}/{path}"))],
                                      stdin=subprocess.DEVNULL)
                     for index in range(streams)]
            try:
                failed = sum(proc.wait(180) != 0 for proc in procs)
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(10)
            wall_s = time.monotonic() - began
        size_bytes = sum(path.stat().st_size for path in files)
        record.update(bytes=size_bytes, wall_s=wall_s, mb_per_s=size_bytes / wall_s / 1e6, failed=failed,
                      wan_bytes=wan["bytes"], emulator_cpu_s=wan["cpu_s"])
        log.info("link ceiling %s: %.0f MB/s with %d curl streams", link.label, record["mb_per_s"], streams)
        return record

    # mounts

    def mount(self, system: str, url: str, scenario: Scenario, cache_dir: Path,
              spoke_args: Sequence[str] = ()) -> CachefsMount | PeerMount:
        mountpoint = self.config.work_dir / "mnt" / system
        if system == "cachefs":
            return CachefsMount(url, mountpoint, cache_dir,
                                ["--cache-size", str(self.config.cache_size_bytes), *self.config.spoke_args,
                                 *spoke_args])
        log_path = self.logs / f"{scenario.slug}.{system}.log"
        if system == "rclone":
            config_file = self.config.work_dir / "rclone.conf"
            config_file.touch()
            argv = ["rclone", "mount", ":http:", str(mountpoint), "--http-url", url + "/", "--vfs-cache-mode", "full",
                    "--read-only", "--cache-dir", str(cache_dir), "--config", str(config_file),
                    "--log-level", "INFO"]
        elif system == "httpdirfs":
            argv = ["httpdirfs", "-f", "--cache", "--cache-location", str(cache_dir), url + "/", str(mountpoint)]
        else:
            raise ValueError(system)
        return PeerMount(system, argv, mountpoint, log_path)

    def run_mounted(self, scenario: Scenario, url: str, cache_dir: Path, extra_args: Sequence[str],
                    spoke_args: Sequence[str] = ()) -> dict[str, Any]:
        """Mount, measure, unmount; the record of one scenario."""
        record: dict[str, Any] = {"name": scenario.name, "system": scenario.system, "link": scenario.link.key
                                  if scenario.link else None, "state": scenario.state}
        mount = self.mount(scenario.system, url, scenario, cache_dir, spoke_args)
        try:
            drop_page_cache()
            pid = mount.pid()
            cpu_before = cpu_seconds(pid) if pid else None
            loop_cpu_before = main_thread_cpu_seconds(pid) if pid else None
            try:
                results = run_workloads(mount.mountpoint, scenario, self.config, extra_args)
            except RuntimeError as exc:
                crashed = mount.crash_reason(pid)
                raise RuntimeError(f"{crashed} ({exc})" if crashed else str(exc)) from None
            cpu_after = cpu_seconds(pid) if pid else None
            loop_cpu_after = main_thread_cpu_seconds(pid) if pid else None
            record["note"] = mount.crash_reason(pid)
            record["results"] = results
            record["resources"] = {
                "pid": pid,
                # `cachefs bench` resets the daemon's peak as each workload starts (its per-phase
                # peaks) and keeps the highest reading: the scenario's peak is the larger of the two.
                "peak_rss_kib": max(filter(None, [peak_rss_kib(pid) if pid else None,
                                                  results.get("daemon_peak_rss_kib")]), default=None),
                "cpu_s": cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None,
                "loop_cpu_s": (loop_cpu_after - loop_cpu_before
                               if loop_cpu_before is not None and loop_cpu_after is not None else None),
                "bytes_read": bytes_read(results),
            }
            record["resources"]["fetched_bytes"] = _fetched_bytes(results)
            if scenario.system == "cachefs" and scenario.state in ("warm", CHECKED_STATE):
                try:  # after the scenario's own figures, which a failure here must not lose
                    record["side_by_side"] = alternate(self.config.data_dir, mount.mountpoint,
                                                       self.config.budget.time_limit_s)
                except OSError as exc:
                    log.error("side-by-side reads of %s failed: %s", scenario.name, exc)
        finally:
            mount.unmount()
        return record

    def run_scenario(self, scenario: Scenario, run: Callable[[Scenario], dict[str, Any]]) -> dict[str, Any]:
        """`run(scenario)` -> record; a failure becomes an error record, not an aborted benchmark."""
        log.info("=== %s", scenario.name)
        began = time.monotonic()
        try:
            record = run(scenario)
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
            log.error("%s failed: %s", scenario.name, exc)
            record = {"name": scenario.name, "system": scenario.system,
                      "link": scenario.link.key if scenario.link else None, "state": scenario.state,
                      "error": str(exc)}
        record["wall_s"] = time.monotonic() - began
        _finish_resources(record)
        self.scenarios.append(record)
        log.info("=== %s done in %.0f s", scenario.name, record["wall_s"])
        return record

    # the plan

    def run_local(self) -> None:
        scenario = Scenario("local", None, "")

        def run(scenario: Scenario) -> dict[str, Any]:
            drop_page_cache()
            results = run_workloads(self.config.data_dir, scenario, self.config, [])
            return {"name": scenario.name, "system": "local", "link": None, "state": "", "results": results,
                    "resources": {"bytes_read": bytes_read(results)}}

        self.run_scenario(scenario, run)

    def prewarm(self, system: str, server: Server, link: Link, cache_dir: Path, port: int) -> dict[str, Any]:
        """Between cold and warm: read the random-read group whole, so that warm random reads find every block.

        The cold run's random reads are too few (a round trip each) to leave a useful cache behind.
        Bytes fetched here are reported apart, in neither scenario.
        """
        scenario = Scenario(system, link, "prewarm")
        record: dict[str, Any] = {"name": scenario.name}
        with self.link_to(server, link, scenario.slug, port) as (url, wan):
            mount = self.mount(system, url, scenario, cache_dir)
            try:
                files = find_dataset(mount.mountpoint, with_small=False).large_group("random")
                result = sequential_read(files, 4, self.config.budget.time_limit_s)
            finally:
                mount.unmount()
        record.update(result.as_dict(), wan_bytes=wan["bytes"])
        log.info("prewarmed %s: %d MiB at %.0f MB/s", scenario.name, result.bytes_read >> 20, result.mb_per_s)
        return record

    def run_system(self, system: str, server: Server | None, link: Link) -> None:
        """Cold, then (over a WAN link) prewarm and warm, on one cache dir that is deleted afterwards.

        cachefs gets a fresh hub per link (`server` None), so hub and spoke run the same checkout.
        """
        cache_dir = self.config.work_dir / "cache" / f"{system}-{link.key}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        cache_dir.mkdir(parents=True)
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, cache_dir, True)
            if server is None:
                server = self.start_hub()
                stack.callback(server.stop)
            port = {"wan": 0}
            cold = self.run_scenario(Scenario(system, link, "cold"), self._measure(server, link, cache_dir, port, []))
            if link.delay_ms is None or "error" in cold:
                return
            try:
                self.prewarms.append(self.prewarm(system, server, link, cache_dir, port["wan"]))
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                log.error("prewarm of %s over %s failed: %s", system, link.label, exc)
            caps = warm_caps(cold.get("results"))
            checked = system == "cachefs" and link.key == CHECKED_LINK
            if checked:
                try:
                    self.prewarms.append(self.verify_for_passthrough(server, link, cache_dir, port["wan"],
                                                                     small_files_read(cold.get("results"))))
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    log.error("reading the cache for passthrough over %s failed: %s", link.label, exc)
            self.run_scenario(Scenario(system, link, "warm"), self._measure(server, link, cache_dir, port, caps))
            if checked:
                self.run_scenario(Scenario(system, link, CHECKED_STATE),
                                  self._measure(server, link, cache_dir, port, caps, CHECKED_ARGS))

    def verify_for_passthrough(self, server: Server, link: Link, cache_dir: Path, port: int,
                               small_cap: int | None) -> dict[str, Any]:
        """Before the warm run: read every file the warm run reads once, whole, through a
        mount whose daemon then verifies each one for the kernel (passthrough), and wait
        (bounded) for the verifications. Blocks the cold run left out are fetched here."""
        scenario = Scenario("cachefs", link, "verify")
        record: dict[str, Any] = {"name": scenario.name}
        with self.link_to(server, link, scenario.slug, port) as (url, wan):
            mount = self.mount("cachefs", url, scenario, cache_dir)
            try:
                dataset = find_dataset(mount.mountpoint)
                files = [*dataset.large, *dataset.small[:small_cap]]
                began = time.monotonic()
                sequential_read(dataset.large, 4, self.config.budget.time_limit_s)
                small_read_all(dataset.small, 16, self.config.budget.time_limit_s, small_cap)
                stats = _wait_for_verified(mount, sum(entry.size_bytes > 0 for entry in files))
                record.update(files=len(files), wall_s=time.monotonic() - began,
                              verified_files=stats["verified_files"] if stats else None)
            finally:
                mount.unmount()
        record["wan_bytes"] = wan["bytes"]
        log.info("verified %s of %d files for passthrough in %.0f s", record.get("verified_files"),
                 record.get("files", 0), record.get("wall_s", 0))
        return record

    def _measure(self, server: Server, link: Link, cache_dir: Path, port: dict[str, int],
                 caps: list[str], spoke_args: Sequence[str] = ()) -> Callable[[Scenario], dict[str, Any]]:
        """A scenario runner: emulator (on the port of earlier runs, if any), mount, workloads."""

        def run(scenario: Scenario) -> dict[str, Any]:
            with self.link_to(server, link, scenario.slug, port["wan"]) as (url, wan):
                port["wan"] = wan["port"] or 0
                record = self.run_mounted(scenario, url, cache_dir, caps, spoke_args)
            record["resources"]["wan_bytes"] = wan["bytes"]
            record["resources"]["emulator_cpu_s"] = wan["cpu_s"]
            return record

        return run


def _wait_for_verified(mount: CachefsMount | PeerMount, files: int,
                       timeout_s: float = VERIFY_TIMEOUT_S) -> dict[str, Any] | None:
    """The mount's stats once `files` files are verified, or when the count stops growing
    for a few seconds or `timeout_s` passes (a file the cache does not hold whole is never verified)."""
    deadline = time.monotonic() + timeout_s
    last, still_since = -1, time.monotonic()
    while True:
        stats = mount.stats() if isinstance(mount, CachefsMount) else None
        verified = stats["verified_files"] if stats else -1
        if verified >= files or time.monotonic() > deadline or time.monotonic() - still_since > 5.0:
            return stats
        if verified != last:
            last, still_since = verified, time.monotonic()
        time.sleep(0.5)


def _fetched_bytes(results: dict[str, Any]) -> int | None:
    before, after = results.get("stats_before"), results.get("stats_after")
    if not before or not after:
        return None
    return after["fetched_bytes"] - before["fetched_bytes"]


def _finish_resources(record: dict[str, Any]) -> None:
    """CPU seconds per GB read; for direct runs (no emulator) the bytes the spoke counted fetching."""
    resources = record.get("resources")
    if not resources:
        return
    if resources.get("cpu_s") is not None and resources.get("bytes_read"):
        resources["cpu_s_per_gb"] = resources["cpu_s"] / (resources["bytes_read"] / 1e9)
        if resources.get("loop_cpu_s") is not None:
            resources["loop_cpu_s_per_gb"] = resources["loop_cpu_s"] / (resources["bytes_read"] / 1e9)
    if record.get("link") == "direct":
        resources["wan_bytes"] = resources.get("fetched_bytes")
