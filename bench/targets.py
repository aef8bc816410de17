"""The project's performance targets, checked against one run's scenarios."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cachefs.bench import report

LINK_MB_PER_S = 125.0  # 1 Gbit/s
COLD_CAPPED_SHARE = 0.9  # of the link rate, cold sequential at 60 ms / 1 Gbit/s
COLD_UNCAPPED_MB_PER_S = 500.0  # cold sequential at 60 ms, no bandwidth cap, where curl was not measured
COLD_UNCAPPED_CEILING_SHARE = 0.9  # of what curl carried through the same link in the same run
WALK_FILES_TARGET = 20_000
SMALL_READ_SHARE = 0.5  # small files read at least half as fast as the same bytes as shards
SMALL_WARM_TIME_RATIO = 1.5  # warm read of every small file at most this times local disk's time
RAND4K_P99_RATIO = 2.0  # warm random 4 KiB p99 at most this times local disk's
PEAK_RSS_LIMIT_BYTES = 128 << 20
COLD_CPU_S_PER_GB = 3.0  # daemon CPU per GB fetched, every phase of every cold run
WARM_CPU_S_PER_GB = 1.0  # daemon CPU per GB read, every phase of every warm run
CHECKED_STATE = "warm, --no-passthrough"  # the warm run of the daemon's checked path (harness.py), no targets


def _find(scenarios: Sequence[dict[str, Any]], system: str, link: str | None, state: str) -> dict[str, Any] | None:
    for scenario in scenarios:
        if (scenario["system"], scenario["link"], scenario["state"]) == (system, link, state) and "results" in scenario:
            return scenario
    return None


# The sequential workloads: name, how the row names it, and its readers.
SEQ_WORKLOADS = (("seq1", "1 thread", 1), ("seq4", "4 threads", 4))
# Decides one sequential workload: check(name, MB/s, local MB/s).
SeqCheck = Callable[[str, float, float | None], bool]


def _workload(scenario: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    if scenario is None:
        return None
    result = scenario["results"]["workloads"].get(name)
    return None if not result or "skipped" in result else result


def _seq_target(label: str, scenario: dict[str, Any] | None, check: SeqCheck,
                local: dict[str, Any] | None = None) -> dict[str, Any]:
    """One row covering the 1-thread and the 4-thread sequential read; met only if both are."""
    if scenario is not None and local is not None and "side_by_side" in scenario:
        # Reads alternated with local ones (side_by_side.py): the medians of each side.
        paired = scenario["side_by_side"]
        rates = [(name, threads, paired[name]["mount"]["median"], paired[name]["local"]["median"] or None)
                 for name, threads, _readers in SEQ_WORKLOADS if name in paired]
        return _seq_row(label, rates, check, show_local=True,
                        note=f" (medians of {paired['rounds']} rounds alternated with local reads)")
    rates = []
    for name, threads, _readers in SEQ_WORKLOADS:
        result = _workload(scenario, name)
        if result is not None:
            local_result = _workload(local, name)
            rates.append((name, threads, result["mb_per_s"], local_result["mb_per_s"] if local_result else None))
    return _seq_row(label, rates, check)


def _seq_row(label: str, rates: list[tuple[str, str, float, float | None]], check: SeqCheck,
             *, show_local: bool = False, note: str = "") -> dict[str, Any]:
    """The row from (name, threads, MB/s, local MB/s) per workload; met only if `check` passes for each."""
    parts = []
    for _name, threads, mb_per_s, local_mb_per_s in rates:
        share = ""
        if local_mb_per_s:
            share = f" = {100 * mb_per_s / local_mb_per_s:.0f} % of local"
            share += f"'s {local_mb_per_s:,.0f}" if show_local else ""
        parts.append(f"{threads}: {mb_per_s:,.0f} MB/s{share}")
    verdicts = [check(name, mb_per_s, local_mb_per_s) for name, _threads, mb_per_s, local_mb_per_s in rates]
    return {"target": label, "measured": "; ".join(parts) + note if parts else "not measured",
            "met": all(verdicts) if verdicts else None}


def _warm_check(_name: str, mb_per_s: float, local_mb_per_s: float | None) -> bool:
    return local_mb_per_s is not None and mb_per_s >= 0.9 * local_mb_per_s and mb_per_s >= 1300


def evaluate(scenarios: Sequence[dict[str, Any]], link_ceilings: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """One row per target: what it asks, what was measured, whether it was met (None: not measured).

    `link_ceilings` (Bench.calibrate's records) put what plain HTTP GETs got
    through each emulated link beside the cold targets: a row whose link
    carried less than the target itself says so (`link_below_target`), so
    that a machine too busy to carry the target is told from a slow spoke.
    """
    local = _find(scenarios, "local", None, "")
    capped_cold = _find(scenarios, "cachefs", "capped", "cold")
    capped_warm = _find(scenarios, "cachefs", "capped", "warm")
    uncapped_cold = _find(scenarios, "cachefs", "uncapped", "cold")
    ceilings = {(record["link"], record["streams"]): record for record in link_ceilings if record.get("mb_per_s")}
    capped_mb = COLD_CAPPED_SHARE * LINK_MB_PER_S
    rows = [
        _cold_target(f"cold sequential at 60 ms / 1 Gbit/s >= 90 % of link rate ({capped_mb:.1f} MB/s)",
                     capped_cold, lambda _name: capped_mb, _per_workload(ceilings, "capped")),
        _uncapped_target(uncapped_cold, _per_workload(ceilings, "uncapped")),
        _seq_target("warm sequential (60 ms / 1 Gbit/s run) >= 90 % of local and >= 1.3 GB/s", capped_warm,
                    _warm_check, local),
    ]
    rows.append(_rand4k_target(local, capped_warm))
    walk = _workload(capped_cold, "walk")
    if walk and walk["files"]:
        scaled_s = walk["wall_s"] * WALK_FILES_TARGET / walk["files"]
        measured = f"{walk['files']:,} files in {walk['wall_s']:.2f} s"
        if walk["files"] != WALK_FILES_TARGET:
            measured += f" (= {scaled_s:.2f} s scaled to {WALK_FILES_TARGET:,})"
        rows.append({"target": "small files: cold walk of 20,000 files < 2 s", "measured": measured,
                     "met": scaled_s < 2.0})
    else:
        rows.append({"target": "small files: cold walk of 20,000 files < 2 s", "measured": "not measured", "met": None})
    rows.append(_small_read_target(capped_cold))
    rows.append(_small_warm_target(local, capped_warm))
    rows.append(_loader_target(local, capped_warm))
    rows.append(_rss_target(scenarios))
    rows.append(_cpu_target(scenarios, "cold", COLD_CPU_S_PER_GB))
    rows.append(_cpu_target(scenarios, "warm", WARM_CPU_S_PER_GB))
    return rows


def _per_workload(ceilings: dict[tuple[str, int], dict[str, Any]], link: str) -> dict[str, dict[str, Any]]:
    """The link's ceilings by sequential workload: each measured with as many curl GETs at once
    as the workload has readers."""
    return {name: ceilings[(link, readers)] for name, _threads, readers in SEQ_WORKLOADS if (link, readers) in ceilings}


def _cold_target(label: str, cold: dict[str, Any] | None, target_mb_per_s: Callable[[str], float],
                 ceilings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A cold sequential row (each read at least its `target_mb_per_s(name)`), with what the
    link itself carried in this run for as many curl GETs at once as it has readers, if measured."""
    row = _seq_target(label, cold, lambda name, mb, _local: mb >= target_mb_per_s(name))
    busy = [(threads, pct) for name, threads, _readers in SEQ_WORKLOADS
            if (pct := report.machine_busy_pct(_workload(cold, name))) is not None]
    if busy:
        row["measured"] += "; the machine's CPUs busy " + ", ".join(f"{pct:.0f} % ({threads})" for threads, pct in busy)
    if not ceilings or row["met"] is None:
        return row
    carried = "; ".join(f"{record['streams']} at a time: {record['mb_per_s']:,.0f} MB/s" for record in ceilings.values())
    source = ", the files read from disk" if all(record.get("page_cache_dropped") for record in ceilings.values()) else ""
    row["measured"] += f"; the link itself carried (curl GETs{source}) {carried}"
    row["link_below_target"] = any(record["mb_per_s"] < target_mb_per_s(name) for name, record in ceilings.items())
    return row


def _uncapped_target(cold: dict[str, Any] | None, ceilings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Cold sequential without a bandwidth cap: each read against what plain curl GETs carried
    through the same emulator in this run with as many at once as it has readers (a read
    without its ceiling against a fixed rate)."""
    def target(name: str) -> float:
        record = ceilings.get(name)
        return COLD_UNCAPPED_CEILING_SHARE * record["mb_per_s"] if record else COLD_UNCAPPED_MB_PER_S

    if not ceilings:
        return _cold_target(f"cold sequential at 60 ms uncapped >= {COLD_UNCAPPED_MB_PER_S:g} MB/s", cold, target, {})
    wanted = ", ".join(f"{threads}: {target(name):,.0f} MB/s" for name, threads, _readers in SEQ_WORKLOADS)
    return _cold_target(f"cold sequential at 60 ms uncapped >= {100 * COLD_UNCAPPED_CEILING_SHARE:.0f} % of what "
                        f"curl carried through the link with as many GETs at once as readers ({wanted})",
                        cold, target, ceilings)


def _rand4k_target(local: dict[str, Any] | None, warm: dict[str, Any] | None) -> dict[str, Any]:
    label = f"warm random 4 KiB pread p99 <= {RAND4K_P99_RATIO:g}x local disk's"
    rand, local_rand = _workload(warm, "rand4k"), _workload(local, "rand4k")
    if not rand or not local_rand:
        return {"target": label, "measured": "not measured", "met": None}
    ratio = rand["p99_ms"] / local_rand["p99_ms"] if local_rand["p99_ms"] else float("inf")
    return {"target": label,
            "measured": f"p99 {rand['p99_ms']:.3f} ms = {ratio:.1f}x local's {local_rand['p99_ms']:.3f} ms "
                        f"(p50 {rand['p50_ms']:.3f} ms)",
            "met": ratio <= RAND4K_P99_RATIO}


def _small_warm_target(local: dict[str, Any] | None, warm: dict[str, Any] | None) -> dict[str, Any]:
    """Warm read of every small file against the same read from local disk (page cache dropped before each)."""
    label = f"small files: warm read-all <= {SMALL_WARM_TIME_RATIO:g}x local disk's time"
    small, local_small = _workload(warm, "small"), _workload(local, "small")
    if not small or not local_small or small["files"] != local_small["files"]:
        return {"target": label, "measured": "not measured", "met": None}
    ratio = small["wall_s"] / local_small["wall_s"] if local_small["wall_s"] else float("inf")
    return {"target": label,
            "measured": f"{small['files']:,} files in {small['wall_s']:.2f} s = {ratio:.1f}x local's "
                        f"{local_small['wall_s']:.2f} s",
            "met": ratio <= SMALL_WARM_TIME_RATIO}


def _cpu_target(scenarios: Sequence[dict[str, Any]], state: str, limit_s_per_gb: float) -> dict[str, Any]:
    """The highest daemon CPU per GB over the phases (workloads) of the cachefs runs in `state`: per GB
    fetched from the hub cold, per GB read warm; phases that moved under `MIN_PHASE_BYTES` are not judged.

    Runs recorded without per-phase figures are judged on the whole run's CPU per GB read.
    """
    cold = state == "cold"
    label = f"daemon CPU per GB {'fetched' if cold else 'read'} <= {limit_s_per_gb:g} s in every phase of every {state} run"
    runs = [scenario for scenario in scenarios if scenario["system"] == "cachefs" and scenario["state"] == state
            and "results" in scenario]
    phases = [(figures[0], f"{phase} of {scenario['name']}", figures[1])
              for scenario in runs for phase, result in scenario["results"]["workloads"].items()
              if (figures := report.phase_cpu(result, cold)) is not None and figures[2] >= report.MIN_PHASE_BYTES]
    counted = "phases"
    if not phases:
        counted = "runs"
        phases = [(resources["cpu_s_per_gb"], scenario["name"], resources.get("loop_cpu_s_per_gb"))
                  for scenario in runs if (resources := scenario.get("resources") or {}).get("cpu_s_per_gb") is not None]
        if not phases:
            return {"target": label, "measured": "not measured", "met": None}
        label = f"daemon CPU per GB read <= {limit_s_per_gb:g} s in every {state} run"
    worst, name, loop = max(phases, key=lambda phase: phase[0])
    split = f", {loop:.1f} of it in the event loop" if loop is not None else ""
    return {"target": label, "measured": f"{worst:.1f} CPU-s per GB ({name}{split}; {len(phases)} {counted})",
            "met": worst <= limit_s_per_gb}


def _small_read_target(cold: dict[str, Any] | None) -> dict[str, Any]:
    """Cold read of every small file against the faster cold sequential read of shards, same link and run."""
    label = f"small files: cold read-all at 60 ms / 1 Gbit/s >= {SMALL_READ_SHARE:g}x the shards' MB/s"
    small = _workload(cold, "small")
    shards = [result["mb_per_s"] for name in ("seq1", "seq4") if (result := _workload(cold, name))]
    if not small or not shards:
        return {"target": label, "measured": "not measured", "met": None}
    share = small["mb_per_s"] / max(shards)
    cut = " (cut short by its time limit)" if not small.get("complete", True) else ""
    return {"target": label,
            "measured": f"{small['mb_per_s']:,.0f} MB/s = {share:.2f}x the shards' {max(shards):,.0f} MB/s{cut}",
            "met": share >= SMALL_READ_SHARE}


def _rss_target(scenarios: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The highest peak RSS of the daemon over every cachefs scenario of the run."""
    label = f"daemon peak RSS <= {PEAK_RSS_LIMIT_BYTES >> 20} MiB in every run"
    measured = [scenario for scenario in scenarios
                if scenario["system"] == "cachefs" and (scenario.get("resources") or {}).get("peak_rss_kib")]
    if not measured:
        return {"target": label, "measured": "not measured", "met": None}
    top = max(measured, key=lambda scenario: scenario["resources"]["peak_rss_kib"])
    peak_bytes = top["resources"]["peak_rss_kib"] * 1024
    workloads = (top.get("results") or {}).get("workloads") or {}
    phases = [(kib, phase) for key, phase in report.PHASES if (kib := report.phase_peak_rss_kib(workloads.get(key)))]
    where = f", in {max(phases)[1]}" if phases else ""  # the workload it peaked in (cachefs bench measures each)
    return {"target": label, "measured": f"{peak_bytes / 2**20:,.0f} MiB ({top['name']}{where}; {len(measured)} runs)",
            "met": peak_bytes <= PEAK_RSS_LIMIT_BYTES}


def _loader_target(local: dict[str, Any] | None, warm: dict[str, Any] | None) -> dict[str, Any]:
    """Warm epoch 1 (fresh mount, page cache dropped) against local epoch 1 (page cache dropped)."""
    label = "loader warm >= 98 % of local samples/s"
    local_loader, warm_loader = _workload(local, "loader"), _workload(warm, "loader")
    if not local_loader or not warm_loader or not local_loader["epochs"] or not warm_loader["epochs"]:
        return {"target": label, "measured": "not measured", "met": None}
    local_rate = local_loader["epochs"][0]["samples_per_s"]
    warm_rate = warm_loader["epochs"][0]["samples_per_s"]
    share = warm_rate / local_rate if local_rate else 0.0
    return {"target": label,
            "measured": f"{warm_rate:,.0f} vs {local_rate:,.0f} samples/s = {100 * share:.1f} %",
            "met": share >= 0.98}
