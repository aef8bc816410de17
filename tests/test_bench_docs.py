"""docs/performance.md's results sections: rendered from the committed JSON, which holds no scratch paths."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mount_helpers import SpokeMount

from bench import docs
from bench.harness import LINKS, RunConfig, Scenario, run_workloads

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "performance.md"
RESULTS = sorted((REPO / "docs" / "bench").glob("results-*.json"))
GENERATED_HEADING = "## Results (generated)"


def test_the_committed_sections_are_what_their_json_renders() -> None:
    text = DOC.read_text()
    blocks = {match["key"]: match[0] for match in docs.BLOCK_RE.finditer(text)}
    assert RESULTS and set(blocks) == {path.stem for path in RESULTS}  # no run without a section, nor the reverse
    for path in RESULTS:
        assert blocks[path.stem] == docs.section_for(path, DOC), f"{path.name}: run python -m bench.docs"
    first = docs.BLOCK_RE.search(text)
    assert first and text.index(GENERATED_HEADING) < first.start()


def test_the_committed_json_holds_no_scratch_paths_or_commits() -> None:
    for path in RESULTS:
        text = path.read_text()
        assert not re.search(r"/(var/)?tmp/|/home/|/root/|/work/", text), path.name
        results = json.loads(text)
        assert "checkout" not in results
        assert not results.get("plot") or "/" not in results["plot"]
        assert (path.parent / results["plot"]).is_file() if results.get("plot") else True


MALFORMED = {
    "syntax": '{"command": "python -m bench",',
    "not an object": "[1, 2]",
    "no scenarios": json.dumps({"command": "python -m bench", "started": "20261201-110308"}),
    "bad date": None,  # a committed run with its date replaced
    "bad command": None,  # a committed run whose command line has an unclosed quote
    "scenario without workloads": None,  # a committed run whose first scenario lost its results' workloads
}


def _malformed(kind: str) -> str:
    if (text := MALFORMED[kind]) is not None:
        return text
    results = json.loads(RESULTS[0].read_text())
    if kind == "bad date":
        results["started"] = "20261399-110308"
    elif kind == "bad command":
        results["command"] += " --spoke-args '--passthrough"
    else:
        del results["scenarios"][0]["results"]["workloads"]
    return json.dumps(results)


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_json_is_refused_with_one_line(kind: str, tmp_path: Path) -> None:
    bad = tmp_path / "results-bad.json"
    bad.write_text(_malformed(kind))
    doc = tmp_path / "performance.md"
    doc.write_text("# Benchmarks\n\nhand-written\n")
    result = subprocess.run([sys.executable, "-m", "bench.docs", str(bad), "--out", str(doc)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.startswith(f"python -m bench.docs: error: {bad}: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert doc.read_text() == "# Benchmarks\n\nhand-written\n"


def test_only_the_text_between_markers_changes_and_new_runs_come_first() -> None:
    text = ("# Benchmarks\n\nintro\n\n<!-- bench:begin results-a -->\nold a\n<!-- bench:end -->\n\nabout a\n\n"
            "<!-- bench:begin results-b -->\nold b\n<!-- bench:end -->\n\nabout b\n")
    new_a = "<!-- bench:begin results-a -->\nnew a\n<!-- bench:end -->"
    new_c = "<!-- bench:begin results-c -->\nnew c\n<!-- bench:end -->"
    assert docs.update(text, {"results-a": new_a, "results-c": new_c}) == (
        "# Benchmarks\n\nintro\n\n" + new_c + "\n\n" + new_a + "\n\nabout a\n\n"
        "<!-- bench:begin results-b -->\nold b\n<!-- bench:end -->\n\nabout b\n")
    assert docs.update("# Benchmarks\n", {"results-c": new_c}) == "# Benchmarks\n\n" + new_c + "\n"


def test_write_docs_copies_a_run_and_adds_its_section(tmp_path: Path) -> None:
    """What `python -m bench --write-docs` does after a run: dated copies, a section that renders them."""
    quick = json.loads((REPO / "docs" / "bench" / "results-quick.json").read_text())
    run_dir = tmp_path / "bench-results" / quick["started"]
    run_dir.mkdir(parents=True)
    (run_dir / "loader-timeline.png").write_bytes(b"\x89PNG plot")
    (run_dir / "results.json").write_text(json.dumps({**quick, "plot": "loader-timeline.png"}))
    docs_dir = tmp_path / "docs"
    docs_dir.mkdir()
    (docs_dir / "performance.md").write_text(f"# Benchmarks\n\n{GENERATED_HEADING}\n\nhand-written\n")

    first = docs.publish(run_dir / "results.json", docs_dir)
    second = docs.publish(run_dir / "results.json", docs_dir)

    assert first.name == "results-quick-20261129.json"
    assert second.name == "results-quick-20261129-224134.json"  # the same day again: not overwritten
    assert (docs_dir / "bench" / "loader-timeline-quick-20261129.png").read_bytes() == b"\x89PNG plot"
    text = (docs_dir / "performance.md").read_text()
    assert text.startswith(f"# Benchmarks\n\n{GENERATED_HEADING}\n\nhand-written\n\n")
    for path in (first, second):
        assert docs.section_for(path, docs_dir / "performance.md") in text
    assert "### Quick run of 2026-11-29\n" in text and "### Quick run of 2026-11-29 22:41\n" in text
    assert "](bench/loader-timeline-quick-20261129.png)" in text
    assert "make bench BENCH_ARGS=\"--quick --peer-links capped,uncapped,direct --dataset-dir DATASET_DIR" in text


def test_the_recorded_command_names_no_directories() -> None:
    argv = ["--quick", "--dataset-dir", "/srv/data", "--work-dir=/var/tmp/w", "--write-docs", "--results-dir", "r"]
    public = docs.public_argv(argv)
    assert public == ["--quick", "--dataset-dir", "DATASET_DIR", "--work-dir=WORK_DIR", "--results-dir", "RESULTS_DIR"]
    assert docs.make_command("python -m bench " + " ".join(public)) == (
        'make bench BENCH_ARGS="--quick --dataset-dir DATASET_DIR --work-dir=WORK_DIR --results-dir RESULTS_DIR"')
    assert docs.make_command("python -m bench") == "make bench"


def test_a_scenario_record_holds_no_mount_or_cache_path(spoke: SpokeMount, dataset: Path, tmp_path: Path) -> None:
    """`cachefs bench` on a real mount records its paths; the bench's record of the run does not."""
    work_dir = tmp_path / "work"
    (work_dir / "logs").mkdir(parents=True)
    config = RunConfig(data_dir=dataset, work_dir=work_dir, results_dir=tmp_path / "results", quick=True,
                       systems=["cachefs"], links=["direct"], peer_links=[], spoke_args=[],
                       bench_args=["--workloads", "seq1,walk"], cache_size_bytes=0)
    results = run_workloads(spoke.mountpoint, Scenario("cachefs", LINKS["direct"], "cold"), config, [])
    raw = json.loads((work_dir / "json" / "cachefs-direct-cold.json").read_text())
    assert str(spoke.mountpoint) in json.dumps(raw)  # what is taken out
    assert results["stats_after"]["fetched_bytes"] > 0 and results["workloads"]["seq1"]["bytes_read"] > 0
    assert str(tmp_path) not in json.dumps(results)
