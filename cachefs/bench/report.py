"""Markdown tables from benchmark results (the dicts `cli.run_all` returns)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

MiB = 1024 * 1024


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    """Milliseconds with sensible precision from 10 µs up."""
    if value is None:
        return "–"
    if value < 1:
        return f"{value:.3f}"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.0f}"


def _cut(result: dict[str, Any]) -> str:
    """Markers: * cut short by its time limit, ! some reads failed."""
    return ("" if result.get("complete", True) else "*") + ("!" if result.get("errors") else "")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- cells shared by both tables ---------------------------------------------------------


def seq_cell(workloads: dict[str, Any], name: str) -> str:
    result = workloads.get(name)
    if not result or "skipped" in result:
        return "–"
    return _fmt(result["mb_per_s"]) + _cut(result)


def latency_cell(workloads: dict[str, Any], name: str) -> str:
    result = workloads.get(name)
    if not result or "skipped" in result:
        return "–"
    return f"{_ms(result['p50_ms'])} / {_ms(result['p99_ms'])}{_cut(result)}"


def walk_cell(workloads: dict[str, Any]) -> str:
    result = workloads.get("walk")
    if not result or "skipped" in result:
        return "–"
    return f"{result['wall_s']:.2f}{_cut(result)}"


def small_cell(workloads: dict[str, Any]) -> str:
    result = workloads.get("small")
    if not result or "skipped" in result:
        return "–"
    return f"{result['wall_s']:.1f} ({_fmt(result['mb_per_s'])}){_cut(result)}"


def epoch_cell(workloads: dict[str, Any], epoch: int) -> str:
    result = workloads.get("loader")
    if not result or "skipped" in result or len(result["epochs"]) < epoch:
        return "–"
    run = result["epochs"][epoch - 1]
    return f"{_fmt(run['samples_per_s'])} ({run['busy_pct']:.0f} %){_cut(run)}"


# -- one directory ------------------------------------------------------------------------


def single_run_table(results: dict[str, Any]) -> str:
    """What `cachefs bench PATH` prints."""
    workloads = results["workloads"]
    rows: list[list[str]] = []
    for name, label in (("seq1", "sequential, 1 thread"), ("seq4", "sequential, 4 threads")):
        if name in workloads:
            result = workloads[name]
            detail = result.get("skipped") or (
                f"{result['files']} files, {result['bytes_read'] / MiB:,.0f} MiB in {result['wall_s']:.2f} s"
                + (f", {result['threads']} threads read" if name == "seq4" and result.get("threads", 4) < 4 else ""))
            rows.append([label, seq_cell(workloads, name) + " MB/s", detail])
    for name, label in (("rand4k", "random 4 KiB pread p50 / p99"), ("rand16k", "random 16 KiB pread p50 / p99")):
        if name in workloads:
            result = workloads[name]
            detail = result.get("skipped") or f"{result['reads']} reads in {result['wall_s']:.1f} s"
            rows.append([label, latency_cell(workloads, name) + " ms", detail])
    if "walk" in workloads:
        result = workloads["walk"]
        rows.append(["tree walk, lstat every entry", walk_cell(workloads) + " s",
                     f"{result['entries']} entries, {result['files']} files"])
    if "small" in workloads:
        result = workloads["small"]
        detail = result.get("skipped") or (
            f"{result['files']} files, {result['bytes_read'] / MiB:,.0f} MiB, {result['threads']} threads")
        rows.append(["small files, read all: s (MB/s)", small_cell(workloads), detail])
    if "loader" in workloads and "skipped" in workloads["loader"]:
        rows.append(["loader: samples/s (busy)", "–", workloads["loader"]["skipped"]])
    elif "loader" in workloads:
        loader = workloads["loader"]
        config = loader["config"]
        for run in loader["epochs"]:
            rows.append([
                f"loader epoch {run['epoch']}: samples/s (busy)",
                epoch_cell(workloads, run["epoch"]),
                f"{run['samples']} samples, {config['workers']} workers, batch {config['batch_size']}, "
                f"compute {config['compute_s'] * 1000:g} ms/batch, read p50/p99 "
                f"{_ms(run['read_p50_ms'])}/{_ms(run['read_p99_ms'])} ms",
            ])
    table = _table(["workload", "result", "detail"], rows)
    return f"{results['label']}\n\n{table}\n\n* = cut short by its time limit, ! = some reads failed"


# -- scenarios side by side -----------------------------------------------------------------

SCENARIO_HEADER = [
    "scenario", "seq 1T MB/s", "seq 4T MB/s", "4 KiB p50/p99 ms", "16 KiB p50/p99 ms", "walk s",
    "small read s (MB/s)", "loader ep1 samples/s (busy)", "loader ep2 samples/s (busy)", "WAN MB",
    "peak RSS MiB", "CPU s/GB",
]


def scenario_row(scenario: dict[str, Any]) -> list[str]:
    """One table row; a failed scenario shows its error."""
    if scenario.get("error"):
        error = scenario["error"] if len(scenario["error"]) <= 160 else scenario["error"][:157] + "..."
        return [scenario["name"], f"failed: {error}"] + ["–"] * (len(SCENARIO_HEADER) - 2)
    workloads = scenario["results"]["workloads"]
    resources = scenario.get("resources", {})
    name = scenario["name"] + (f" ({scenario['note']})" if scenario.get("note") else "")
    wan_bytes = resources.get("wan_bytes")
    rss_kib = resources.get("peak_rss_kib")
    return [
        name,
        seq_cell(workloads, "seq1"),
        seq_cell(workloads, "seq4"),
        latency_cell(workloads, "rand4k"),
        latency_cell(workloads, "rand16k"),
        walk_cell(workloads),
        small_cell(workloads),
        epoch_cell(workloads, 1),
        epoch_cell(workloads, 2),
        _fmt(wan_bytes / 1e6) if wan_bytes is not None else "–",
        _fmt(rss_kib / 1024) if rss_kib is not None else "–",
        _cpu_cell(resources),
    ]


def _cpu_cell(resources: dict[str, Any]) -> str:
    """CPU s/GB of the daemon, and of its event loop alone where measured (the rest: worker threads)."""
    cell = _fmt(resources.get("cpu_s_per_gb"), 1)
    loop = resources.get("loop_cpu_s_per_gb")
    return cell if loop is None else f"{cell} (loop {_fmt(loop, 1)})"


# -- daemon CPU per phase -------------------------------------------------------------------

PHASES = (("seq1", "seq 1T"), ("seq4", "seq 4T"), ("rand4k", "4 KiB"), ("rand16k", "16 KiB"), ("walk", "walk"),
          ("small", "small files"), ("loader", "loader"))
MIN_PHASE_BYTES = 100_000_000  # below this a phase's CPU per GB is mostly its fixed costs: shown, not judged
READ_PHASES = tuple((name, label) for name, label in PHASES if name != "walk")  # the phases that read bytes


def workload_bytes_read(result: dict[str, Any]) -> int:
    """Bytes one workload read through the filesystem (a loader's: over its epochs)."""
    if "epochs" in result:
        return sum(epoch["bytes_read"] for epoch in result["epochs"])
    return int(result.get("bytes_read", 0))


def phase_cpu(result: dict[str, Any] | None, cold: bool) -> tuple[float, float | None, int] | None:
    """Daemon CPU-s per GB of one workload, its event loop's share, and the bytes it is per: fetched
    from the hub in a cold run, read in a warm one. None where the daemon's usage was not recorded
    or the workload moved no bytes on that basis."""
    if not result or not (usage := result.get("daemon")):
        return None
    basis = usage["fetched_bytes"] if cold else workload_bytes_read(result)
    if basis <= 0:
        return None
    loop = usage["loop_cpu_s"] * 1e9 / basis if usage.get("loop_cpu_s") is not None else None
    return usage["cpu_s"] * 1e9 / basis, loop, basis


def _phase_cell(result: dict[str, Any] | None, cold: bool) -> str:
    figures = phase_cpu(result, cold)
    if figures is None:
        return "–"
    per_gb, loop, basis = figures
    cell = _fmt(per_gb, 1) + ("" if loop is None else f" ({_fmt(loop, 1)})")
    return cell if basis >= MIN_PHASE_BYTES else f"({cell}, {_fmt(basis / 1e6)} MB)"


def _cachefs_runs(scenarios: Sequence[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(scenario, its workloads' results) of each cachefs run that has results."""
    for scenario in scenarios:
        if scenario["system"] == "cachefs" and "results" in scenario:
            yield scenario, scenario["results"]["workloads"]


def phase_cpu_table(scenarios: Sequence[dict[str, Any]]) -> str:
    """Daemon CPU-s per GB in each workload of each cachefs run: per GB fetched cold, per GB read warm."""
    rows = []
    for scenario, workloads in _cachefs_runs(scenarios):
        cold = scenario["state"] == "cold"
        rows.append([scenario["name"] + (" (per GB fetched)" if cold else " (per GB read)"),
                     *(_phase_cell(workloads.get(name), cold) for name, _ in PHASES)])
    return _table(["daemon CPU-s per GB (event loop's)", *(label for _, label in PHASES)], rows)


def phase_node_cpu(result: dict[str, Any] | None) -> tuple[float, float | None, int] | None:
    """CPU-s per GB read of one workload's readers and of the daemon serving them (None off
    cachefs), and the bytes read. None where the readers' CPU was not recorded or nothing was read."""
    if not result or "readers_cpu_s" not in result:
        return None
    basis = workload_bytes_read(result)
    if basis <= 0:
        return None
    usage = result.get("daemon")
    return result["readers_cpu_s"] * 1e9 / basis, usage["cpu_s"] * 1e9 / basis if usage else None, basis


def _node_cell(result: dict[str, Any] | None) -> str:
    figures = phase_node_cpu(result)
    if figures is None:
        return "–"
    readers, daemon, basis = figures
    cell = _fmt(readers, 1) if daemon is None else f"{_fmt(readers + daemon, 1)} ({_fmt(readers, 1)} + {_fmt(daemon, 1)})"
    return cell if basis >= MIN_PHASE_BYTES else f"({cell}, {_fmt(basis / 1e6)} MB)"


def node_cpu_table(scenarios: Sequence[dict[str, Any]]) -> str:
    """CPU-s per GB read in each workload, the readers' and the cachefs daemon's together: what
    reading the data costs the node, local disk's readers alone beside it."""
    rows = [[scenario["name"], *(_node_cell(scenario["results"]["workloads"].get(name)) for name, _ in READ_PHASES)]
            for scenario in scenarios
            if scenario["system"] in ("local", "cachefs") and "results" in scenario]
    return _table(["CPU-s per GB read: readers + daemon", *(label for _, label in READ_PHASES)], rows)


def machine_busy_pct(result: dict[str, Any] | None) -> float | None:
    """How busy the machine's CPUs were in one workload (all cores, every process), in %."""
    cpu = (result or {}).get("machine_cpu")
    if not cpu or cpu["busy_s"] + cpu["idle_s"] <= 0:
        return None
    return 100 * cpu["busy_s"] / (cpu["busy_s"] + cpu["idle_s"])


def machine_busy_table(scenarios: Sequence[dict[str, Any]]) -> str:
    """The machine's CPUs' busy % in each workload of each run (every system)."""
    rows = [[scenario["name"], *(f"{pct:.0f} %" if (pct := machine_busy_pct(scenario["results"]["workloads"].get(name)))
                                 is not None else "–" for name, _ in PHASES)]
            for scenario in scenarios if "results" in scenario]
    return _table(["machine CPUs busy", *(label for _, label in PHASES)], rows)


def phase_peak_rss_kib(result: dict[str, Any] | None) -> int | None:
    """The daemon's peak RSS in one workload (cachefs bench resets it as each starts), in KiB."""
    return ((result or {}).get("daemon") or {}).get("peak_rss_kib")


def phase_rss_table(scenarios: Sequence[dict[str, Any]]) -> str:
    """The daemon's peak RSS in MiB in each workload of each cachefs run."""
    rows = [[scenario["name"], *(_fmt(kib / 1024) if (kib := phase_peak_rss_kib(workloads.get(name))) else "–"
                                 for name, _ in PHASES)]
            for scenario, workloads in _cachefs_runs(scenarios)]
    return _table(["daemon peak RSS MiB", *(label for _, label in PHASES)], rows)


def scenarios_table(scenarios: Sequence[dict[str, Any]]) -> str:
    return _table(SCENARIO_HEADER, [scenario_row(scenario) for scenario in scenarios])


def side_by_side_table(scenarios: Sequence[dict[str, Any]]) -> str:
    """Warm sequential reads alternated with local ones (side_by_side.py): medians and ranges, MB/s."""
    rows = []
    for scenario in scenarios:
        paired = scenario.get("side_by_side")
        if not paired:
            continue
        cells = [scenario["name"]]
        for name in ("seq1", "seq4"):
            sides = paired.get(name)
            if not sides:
                cells += ["–", "–", "–"]
                continue
            local, mount = sides["local"], sides["mount"]
            cells += [_median_and_range(local), _median_and_range(mount),
                      f"{100 * mount['median'] / local['median']:.0f} %" if local["median"] else "–"]
        rows.append(cells)
    if not rows:
        return ""
    header = ["warm run, side by side with local", "local 1T", "mount 1T", "share 1T", "local 4T", "mount 4T", "share 4T"]
    return _table(header, rows)


def _median_and_range(side: dict[str, Any]) -> str:
    rates = side["mb_per_s"]
    return f"{_fmt(side['median'])} ({_fmt(min(rates))}-{_fmt(max(rates))})"


def targets_table(targets: Sequence[dict[str, Any]]) -> str:
    rows = [[target["target"], target["measured"], _verdict(target)] for target in targets]
    return _table(["target", "measured", "met"], rows)


def _verdict(target: dict[str, Any]) -> str:
    verdict = {True: "yes", False: "**no**", None: "n/a"}[target["met"]]
    if target["met"] is False and target.get("link_below_target"):
        verdict += " (the link carried less than the target in this run)"
    return verdict


def ceilings_table(ceilings: Sequence[dict[str, Any]]) -> str:
    """Plain HTTP GETs through each link, so many at once: what the link and the emulator can carry on this machine."""
    rows = []
    for ceiling in ceilings:
        streams = str(ceiling.get("streams", "–"))
        if ceiling.get("error"):
            rows.append([ceiling["label"], streams, f"failed: {ceiling['error']}", "–"])
            continue
        cpu = ceiling.get("emulator_cpu_s")
        cpu_cell = f"{cpu / (ceiling['bytes'] / 1e9):.1f}" if cpu is not None and ceiling["bytes"] else "–"
        rows.append([ceiling["label"], streams, f"{ceiling['mb_per_s']:,.0f}" + ("!" if ceiling.get("failed") else ""),
                     cpu_cell])
    return _table(["link (curl)", "GETs at once", "MB/s", "emulator CPU s/GB"], rows)
