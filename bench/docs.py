"""The results sections of docs/performance.md, rendered from the bench's results JSON.

    python -m bench.docs docs/bench/results-full.json [...] --out docs/performance.md

Each run's section sits between `<!-- bench:begin KEY -->` and
`<!-- bench:end -->`, KEY being its JSON's file name without `.json`; only
what lies between the markers is rewritten, so the text around them stays.
A run without a section yet gets one before the first section (newest
first). `python -m bench --write-docs` copies its JSON and plot into
docs/bench/ and runs this at its end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachefs.bench import report

BEGIN = "<!-- bench:begin {key} -->"
END = "<!-- bench:end -->"
BLOCK_RE = re.compile(r"<!-- bench:begin (?P<key>[A-Za-z0-9_.-]+) -->\n.*?<!-- bench:end -->", re.DOTALL)
DOCS_DIR = Path(__file__).resolve().parents[1] / "docs"
# The options of `python -m bench` that name directories of one machine: shown as these words.
PATH_OPTIONS = {"--dataset-dir": "DATASET_DIR", "--work-dir": "WORK_DIR", "--results-dir": "RESULTS_DIR"}

LEGEND = (
    "Latencies are single-threaded pread p50 / p99. Loader: samples/s (accelerator busy %); epoch 1 of a cold "
    "run is cold, epoch 2 re-reads the same samples. WAN MB: bytes through the emulator to the spoke (direct: "
    "bytes the spoke fetched). CPU s/GB: daemon CPU time per GB read by the workloads (loop: of it, the event "
    "loop's thread; the rest ran on worker threads). * = cut short by its time limit, ! = some reads failed."
)

PHASE_LEGEND = (
    "Daemon CPU time per GB in each workload: per GB fetched from the hub in a cold run, per GB read in a warm "
    "one; in brackets the event loop's thread (the rest ran on worker threads). A figure in brackets with its "
    "MB moved too few bytes to be judged against the CPU targets."
)


MACHINE_CPU_LEGEND = (
    "How busy the machine's CPUs were in each workload: all cores and every process (the readers, the "
    "daemon, the hub, the WAN emulator), from /proc/stat. Near 100 %, the machine set the pace, not any "
    "one of them."
)
NODE_CPU_LEGEND = (
    "What reading the data cost the node, per GB read in each workload: the CPU time of `cachefs bench`'s "
    "readers (its threads and the loader's worker processes, in user and kernel mode) plus the daemon's; in "
    "brackets readers + daemon. Local disk has only its readers. The readers' kernel time includes reading "
    "from the disk what the daemon did not read ahead for them, so a daemon that pages files in for its "
    "readers moves CPU from their side to its own."
)


PHASE_RSS_LEGEND = (
    "The daemon's peak resident memory in each workload: `cachefs bench` resets the daemon's peak (VmHWM) as each "
    "workload starts. The peak RSS of a run, above, is the highest of them and of the time between."
)


class MalformedResults(ValueError):
    """A results JSON this module cannot render."""


# -- the recorded command ---------------------------------------------------------------------


def public_argv(argv: Sequence[str]) -> list[str]:
    """`argv` as a run records it: the directories of PATH_OPTIONS as their placeholder words,
    without --write-docs (where the results went, not what was measured)."""
    public: list[str] = []
    replace_next = None
    for arg in argv:
        if arg == "--write-docs":
            continue
        if replace_next:
            public.append(replace_next)
            replace_next = None
            continue
        option, equals, _ = arg.partition("=")
        if option in PATH_OPTIONS:
            if equals:
                public.append(f"{option}={PATH_OPTIONS[option]}")
                continue
            replace_next = PATH_OPTIONS[option]
        public.append(arg)
    return public


def make_command(command: str) -> str:
    """The `make bench` line that runs `command` (`python -m bench ARGS`, as the JSON records it)."""
    args = shlex.split(command)[3:]
    return "make bench" + (f' BENCH_ARGS="{shlex.join(args)}"' if args else "")


# -- one run ------------------------------------------------------------------------------------


def validate(results: Any) -> dict[str, Any]:
    """`results` if it has what rendering reads, else MalformedResults naming the first thing missing."""
    if not isinstance(results, dict):
        raise MalformedResults("not a JSON object")
    expected: dict[str, type | tuple[type, ...]] = {
        "command": str, "started": str, "wall_s": (int, float), "machine": dict, "dataset": dict, "versions": dict,
        "unavailable": dict, "link_ceilings": list, "scenarios": list, "targets": list}
    for key, kind in expected.items():
        if not isinstance(results.get(key), kind):
            raise MalformedResults(f"{key!r} missing or not a {getattr(kind, '__name__', 'number')}")
    try:
        if shlex.split(results["command"])[:2] != ["python", "-m"]:
            raise ValueError
    except ValueError:
        raise MalformedResults("'command' is not a `python -m bench` command line") from None
    try:
        datetime.datetime.strptime(results["started"], "%Y%m%d-%H%M%S")
    except ValueError:
        raise MalformedResults("'started' is not a time as YYYYMMDD-HHMMSS") from None
    for key in ("shard_count", "shard_bytes", "small_files", "small_dirs", "small_mean_bytes"):
        if not isinstance(results["dataset"].get(key), int):
            raise MalformedResults(f"'dataset' has no integer {key!r}")
    if not isinstance(results["machine"].get("cpus"), int):
        raise MalformedResults("'machine' has no integer 'cpus'")
    if not all(isinstance(scenario, dict) and isinstance(scenario.get("name"), str)
               for scenario in results["scenarios"]):
        raise MalformedResults("a scenario is not an object with a 'name'")
    return results


def facts(results: dict[str, Any]) -> str:
    """Dataset, machine, peers' versions and wall time, as the JSON records them."""
    spec, machine = results["dataset"], results["machine"]
    machine_parts = [f"{machine['cpus']} cores"]
    if machine.get("cpu_model"):
        machine_parts.append(machine["cpu_model"])
    if machine.get("memory_bytes"):
        machine_parts.append(f"{machine['memory_bytes'] / 2**30:.0f} GiB of memory")
    if machine.get("kernel"):
        machine_parts.append(f"kernel {machine['kernel']}")
    text = (f"Dataset: {spec['shard_count']} shards x {spec['shard_bytes'] / 2**20:g} MiB, "
            f"{spec['small_files']:,} small files (~{spec['small_mean_bytes'] / 1024:g} KiB) in "
            f"{spec['small_dirs']} directories. Machine: {', '.join(machine_parts)}.")
    versions = [version if version.lower().startswith(name.lower()) else f"{name} {version}"
                for name, version in results["versions"].items() if version]
    if versions:
        text += f" Peers: {', '.join(versions)}."
    return text + f" Wall time {results['wall_s'] / 60:.0f} min."


def side_by_side_section(scenarios: Sequence[dict[str, Any]]) -> str:
    """The table of warm reads alternated with local ones, and what it means (empty if none ran)."""
    table = report.side_by_side_table(scenarios)
    if not table:
        return ""
    rounds = next(scenario["side_by_side"]["rounds"] for scenario in scenarios if scenario.get("side_by_side"))
    return (f"{table}\n\nEach warm cachefs run also reads the seq1 and seq4 files {rounds} times more, "
            "alternating with the same reads from the local disk, the page cache dropped before each: median "
            "(range) MB/s. The warm targets are judged on these medians: a virtual machine's disk can read the "
            "same files at very different speeds minutes apart.")


def render_run(results: dict[str, Any], numbers: str | None = None, plot: str | None = None) -> str:
    """A run's facts and tables: what `python -m bench` prints and the body of its docs section.

    `numbers` and `plot` are the links to its JSON and its plot (none if None).
    """
    results = validate(results)
    try:
        lines = [facts(results)]
        for what, href in (("Numbers", numbers), ("Plot", plot)):
            if href:
                lines[0] += f" {what}: [{Path(href).name}]({href})."
        if plot:
            lines += ["", f"![cold-to-warm loader run]({plot})"]
        lines += ["", report.scenarios_table(results["scenarios"]), "", LEGEND]
        phases = [result for scenario in results["scenarios"]
                  for result in scenario.get("results", {}).get("workloads", {}).values()]
        if any("daemon" in result for result in phases):
            lines += ["", report.phase_cpu_table(results["scenarios"]), "", PHASE_LEGEND]
        if any("readers_cpu_s" in result for result in phases):
            lines += ["", report.node_cpu_table(results["scenarios"]), "", NODE_CPU_LEGEND]
        if any("machine_cpu" in result for result in phases):
            lines += ["", report.machine_busy_table(results["scenarios"]), "", MACHINE_CPU_LEGEND]
        if any(report.phase_peak_rss_kib(result) for result in phases):
            lines += ["", report.phase_rss_table(results["scenarios"]), "", PHASE_RSS_LEGEND]
        if side_by_side := side_by_side_section(results["scenarios"]):
            lines += ["", side_by_side]
        lines += ["", report.targets_table(results["targets"]), "", report.ceilings_table(results["link_ceilings"])]
        if results["unavailable"]:
            lines += ["", "Not measured: " + "; ".join(f"{name}: {why}" for name, why in results["unavailable"].items())]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration) as exc:
        raise MalformedResults(f"cannot render: {type(exc).__name__}: {exc}") from None
    return "\n".join(lines)


def render_section(key: str, results: dict[str, Any], numbers: str, plot: str | None) -> str:
    """The docs section of one run, markers included."""
    results = validate(results)
    started = datetime.datetime.strptime(results["started"], "%Y%m%d-%H%M%S")
    kind = "Quick run" if "--quick" in shlex.split(results["command"]) else "Full run"
    # A second run of a day is published under its start time (`publish`): so is its heading.
    when = f"{started:%Y-%m-%d %H:%M}" if key.endswith(results["started"]) else f"{started:%Y-%m-%d}"
    return "\n".join([
        BEGIN.format(key=key),
        f"### {kind} of {when}",
        "",
        "```",
        make_command(results["command"]),
        "```",
        "",
        render_run(results, numbers, plot),
        END,
    ])


# -- the docs file -----------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    try:
        return validate(json.loads(path.read_text()))
    except OSError as exc:
        raise MalformedResults(f"cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedResults(f"not JSON: {exc}") from None


def section_for(path: Path, doc: Path) -> str:
    """The section of the results JSON at `path`, its links relative to `doc`."""
    try:
        results = load(path)
        numbers = os.path.relpath(path, doc.parent)
        plot = os.path.relpath(path.parent / results["plot"], doc.parent) if results.get("plot") else None
        return render_section(path.stem, results, numbers, plot)
    except (MalformedResults, TypeError) as exc:
        raise MalformedResults(f"{path}: {exc}") from None


def update(text: str, sections: dict[str, str]) -> str:
    """`text` with each KEY's section replaced; new ones go before the first existing section, or at the end."""
    rest = dict(sections)

    def replace(match: re.Match[str]) -> str:
        return rest.pop(match["key"], match[0])

    text = BLOCK_RE.sub(replace, text)
    if rest:
        new = "\n\n".join(rest.values()) + "\n"
        first = BLOCK_RE.search(text)
        text = text[:first.start()] + new + "\n" + text[first.start():] if first else text.rstrip("\n") + "\n\n" + new
    return text


def write(paths: Sequence[Path], doc: Path) -> None:
    """Rewrite the sections of `paths` in `doc`; nothing is written if any JSON is malformed."""
    sections = {path.stem: section_for(path, doc) for path in paths}
    text = doc.read_text() if doc.exists() else ""
    doc.write_text(update(text, sections))


def publish(results_json: Path, docs_dir: Path = DOCS_DIR) -> Path:
    """Copy a run's JSON (and plot) into docs_dir/bench/ under a dated name and write its section
    into docs_dir/performance.md; the copied JSON's path."""
    results = load(results_json)
    kind = "quick" if "--quick" in shlex.split(results["command"]) else "full"
    stem = f"results-{kind}-{results['started'][:8]}"
    target_dir = docs_dir / "bench"
    target_dir.mkdir(parents=True, exist_ok=True)
    if (target_dir / f"{stem}.json").exists():
        stem = f"results-{kind}-{results['started']}"
    if results.get("plot") and (results_json.parent / results["plot"]).is_file():
        plot_name = f"loader-timeline-{stem.removeprefix('results-')}.png"
        shutil.copyfile(results_json.parent / results["plot"], target_dir / plot_name)
        results = {**results, "plot": plot_name}
    else:
        results = {**results, "plot": None}
    target = target_dir / f"{stem}.json"
    target.write_text(json.dumps(results, indent=1) + "\n")
    write([target], docs_dir / "performance.md")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.docs", description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="results JSON files (docs/bench/results-*.json)")
    parser.add_argument("--out", type=Path, default=DOCS_DIR / "performance.md", help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        write(args.results, args.out)
    except MalformedResults as exc:
        print(f"python -m bench.docs: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"python -m bench.docs: error: {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
