"""`python -m bench` (`make bench`): local disk, cachefs, rclone, httpdirfs; cold and warm over a WAN.

    python -m bench --quick          # a few minutes: 2 GiB of shards, 2,000 small files
    python -m bench                  # under 30 minutes: 4 GiB of shards, 20,000 small files

Builds a dataset, starts a hub and a static HTTP server (for the peers),
puts the WAN emulator in front of them, and runs `cachefs bench` on every
scenario. Prints Markdown tables; writes bench-results/<timestamp>/
results.json and loader-timeline.png, and with --write-docs the run's
section of docs/performance.md (bench/docs.py). Everything it starts is
stopped and unmounted on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from cachefs.config import parse_size

from . import docs, targets
from .dataset import FULL_SPEC, QUICK_SPEC, DatasetSpec, build_dataset
from .harness import LINKS, PEERS, Bench, RunConfig
from .plot import plot_loader

log = logging.getLogger("bench")

APT_TIMEOUT_S = 600.0
# curl GETs at once measuring what a link carries: as many as the seq1 and seq4 workloads
# have readers, each judged against its own count (targets.py)
CALIBRATION_STREAMS = (1, 4)
CALIBRATION_FILES = 8  # shards the streams share out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small dataset and budgets: a few minutes")
    parser.add_argument("--systems", default="cachefs,rclone,httpdirfs",
                        help="comma-separated systems besides local disk (default: %(default)s)")
    parser.add_argument("--links", default="capped,uncapped,direct",
                        help=f"links for cachefs, from {','.join(LINKS)} (default: %(default)s)")
    parser.add_argument("--peer-links",
                        help="links for rclone and httpdirfs (default: capped)")
    parser.add_argument("--dataset-dir", type=Path, help="build the dataset here and keep it (reused if it matches)")
    parser.add_argument("--work-dir", type=Path, help="mounts, caches, logs (default: a temp dir, removed after)")
    parser.add_argument("--results-dir", type=Path, default=Path("bench-results"), help="default: %(default)s")
    parser.add_argument("--shard-count", type=int, help="number of shard files")
    parser.add_argument("--shard-size", help="size of each shard, e.g. 128M")
    parser.add_argument("--small-files", type=int, help="number of small files")
    parser.add_argument("--small-dirs", type=int, help="directories the small files are spread over")
    parser.add_argument("--small-size", help="mean small file size, e.g. 100K")
    parser.add_argument("--spoke-args", default="", help="extra `cachefs mount` options, one quoted string")
    parser.add_argument("--bench-args", default="", help="extra `cachefs bench` options, one quoted string")
    parser.add_argument("--no-install", action="store_true", help="do not apt-get install missing peers")
    parser.add_argument("--write-docs", action="store_true",
                        help="copy the results into docs/bench/ and write their section of docs/performance.md")
    parser.add_argument("--keep-work", action="store_true", help="keep the work dir (logs, per-scenario JSON)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    base = QUICK_SPEC if args.quick else FULL_SPEC
    return dataclasses.replace(
        base,
        shard_count=args.shard_count or base.shard_count,
        shard_bytes=parse_size(args.shard_size) if args.shard_size else base.shard_bytes,
        small_files=base.small_files if args.small_files is None else args.small_files,
        small_dirs=args.small_dirs or base.small_dirs,
        small_mean_bytes=parse_size(args.small_size) if args.small_size else base.small_mean_bytes,
    )


def _split(text: str, allowed: Any, what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in allowed:
            raise SystemExit(f"python -m bench: error: unknown {what} {name!r}")
    return names


# -- peers ------------------------------------------------------------------------------------


def ensure_tool(name: str, install: bool) -> str | None:
    """None if `name` is on PATH (installing it with apt if allowed), else why it is not."""
    if shutil.which(name):
        return None
    if not install:
        return "not installed (--no-install)"
    try:
        policy = subprocess.run(["apt-cache", "policy", name], capture_output=True, text=True, timeout=60)
        if "Candidate:" not in policy.stdout or "Candidate: (none)" in policy.stdout:
            return "no Debian package candidate (apt-cache policy)"
        log.info("installing %s with apt-get", name)
        result = subprocess.run(["apt-get", "install", "-y", "-qq", name], capture_output=True, text=True,
                                timeout=APT_TIMEOUT_S, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except (OSError, subprocess.SubprocessError) as exc:
        return f"apt failed: {exc}"
    if result.returncode != 0 or not shutil.which(name):
        return f"apt-get install failed: {result.stderr.strip().splitlines()[-1:] or result.returncode}"
    return None


def tool_version(name: str) -> str | None:
    """The Debian package's version of `name` if it is one, else the first line of `--version` naming it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        package = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True,
                                 timeout=30)
        if package.returncode == 0 and package.stdout.strip():
            return package.stdout.strip()
    try:
        result = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    # httpdirfs prints libfuse's version on stdout and its own on stderr.
    lines = (result.stdout + "\n" + result.stderr).strip().splitlines()
    return next((line.strip() for line in lines if name.lower() in line.lower()), lines[0] if lines else None)


def machine_facts() -> dict[str, Any]:
    """What the figures depend on besides the code: cores, their model, memory, kernel."""
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "kernel": os.uname().release}
    with contextlib.suppress(OSError):
        model = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), None)
        if model:
            facts["cpu_model"] = " ".join(model.partition(":")[2].split())
    with contextlib.suppress(OSError, ValueError, IndexError):
        memory = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
        facts["memory_bytes"] = int(memory.split()[1]) * 1024
    return facts


# -- output -----------------------------------------------------------------------------------


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    systems = _split(args.systems, ("cachefs", *PEERS), "system")
    links = _split(args.links, LINKS, "link")
    peer_links = _split(args.peer_links, LINKS, "link") if args.peer_links else ["capped"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.results_dir / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    unavailable = {peer: why for peer in PEERS if peer in systems and (why := ensure_tool(peer, not args.no_install))}
    systems = [system for system in systems if system not in unavailable]
    spec = dataset_spec(args)
    with contextlib.ExitStack() as stack:
        work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="cachefs-bench-", dir="/var/tmp"))
        work_dir.mkdir(parents=True, exist_ok=True)
        if not args.keep_work:
            stack.callback(shutil.rmtree, work_dir, True)
        data_dir = args.dataset_dir or work_dir / "data"
        build_dataset(data_dir, spec)
        config = RunConfig(
            data_dir=data_dir.resolve(), work_dir=work_dir.resolve(), results_dir=out_dir, quick=args.quick,
            systems=systems, links=links, peer_links=peer_links, spoke_args=shlex.split(args.spoke_args),
            bench_args=shlex.split(args.bench_args),
            cache_size_bytes=2 * (spec.shard_total_bytes + spec.small_files * spec.small_mean_bytes * 2),
        )
        began = time.monotonic()
        bench = Bench(config, stack)
        static = bench.start_static()
        bench.run_local()
        shards = sorted((data_dir / "shards").glob("*.bin"))[:CALIBRATION_FILES]
        ceilings = [bench.calibrate(static, LINKS[key], shards, min(streams, len(shards)))
                    for key in dict.fromkeys([*links, *peer_links]) for streams in CALIBRATION_STREAMS]
        for system in systems:
            for key in links if system == "cachefs" else peer_links:
                bench.run_system(system, None if system == "cachefs" else static, LINKS[key])
        results: dict[str, Any] = {
            "command": "python -m bench " + shlex.join(docs.public_argv(sys.argv[1:])),
            "started": stamp,
            "wall_s": time.monotonic() - began,
            "machine": machine_facts(),
            "dataset": dataclasses.asdict(spec),
            "versions": {peer: tool_version(peer) for peer in PEERS if peer in systems},
            "unavailable": unavailable,
            "link_ceilings": ceilings,
            "scenarios": bench.scenarios,
            "prewarms": bench.prewarms,
            "targets": targets.evaluate(bench.scenarios, ceilings),
        }
    results["plot"] = _plot(results["scenarios"], out_dir)
    results_json = out_dir / "results.json"
    results_json.write_text(json.dumps(results, indent=1) + "\n")
    print(docs.render_run(results, str(results_json), str(out_dir / results["plot"]) if results["plot"] else None))
    if args.write_docs:
        print(f"\nIn the docs: {docs.publish(results_json)}")
    return 0


def _plot(scenarios: list[dict[str, Any]], out_dir: Path) -> str | None:
    """The file name of the loader timeline of cachefs at 60 ms / 1 Gbit/s cold, peers and local disk beside it."""
    main = next((s for s in scenarios if (s["system"], s["link"], s["state"]) == ("cachefs", "capped", "cold")
                 and "results" in s), None)
    if main is None:
        return None
    others = [s for s in scenarios if "results" in s and (s["system"] == "local" or
                                                          (s["link"] == "capped" and s["state"] == "cold"
                                                           and s["system"] != "cachefs"))]
    path = plot_loader(main, others, out_dir / "loader-timeline.png")
    return path.name if path else None  # beside results.json


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return run(args)
    except KeyboardInterrupt:
        log.error("interrupted; everything started was stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())
