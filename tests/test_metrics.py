"""Prometheus metrics of the spoke and systemd readiness, through their real interfaces."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE
from hub_helpers import free_port, hub_env, wait_until
from mount_helpers import metrics_text, mounted_spoke, parse_metrics, read_uncached, spoke_metrics, wait_for_stats

from cachefs.bench.memory import status_kib


def test_metrics_match_what_was_read(hub, dataset: Path, tmp_path: Path) -> None:
    port = free_port()
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--metrics-listen", f"127.0.0.1:{port}")) as spoke:
        relative = "shards/shard-000.bin"
        size = (dataset / relative).stat().st_size
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        # Read-ahead may also have asked for the head of the next shard: all of it written.
        stats = wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == stats["fetched_bytes"] >= size)
        # The cache writer gives its room back just after the index commit the stats count.
        assert wait_until(lambda: spoke_metrics(port)["cachefs_write_queue_bytes"] == 0, 20)
        metrics = spoke_metrics(port)
    assert metrics["cachefs_read_bytes_total"] == 2 * size == stats["read_bytes"]
    assert metrics["cachefs_fetched_bytes_total"] == stats["fetched_bytes"]
    assert metrics["cachefs_block_hits_total"] == stats["block_hits"] > 0
    assert metrics["cachefs_block_misses_total"] == stats["block_misses"]
    assert metrics["cachefs_cache_used_bytes"] == stats["cached_bytes"]
    assert metrics["cachefs_cache_capacity_bytes"] == 10 * 2**30
    assert metrics["cachefs_read_duration_seconds_count"] == stats["reads"]
    assert metrics["cachefs_fetch_duration_seconds_count"] == stats["fetches"]
    assert metrics["cachefs_prefetch_used_blocks_total"] <= metrics["cachefs_prefetch_blocks_total"]
    assert not any("path" in name or "shard" in name for name in metrics)  # never a path in a label
    # Where the daemon's block bytes are: nothing left for the cache writer; the blocks the
    # readers used last kept in memory (at most --memory-blocks of them), for every owner a value.
    assert metrics["cachefs_write_waiting_fetches"] == 0
    held = {owner: metrics[f'cachefs_held_block_bytes{{owner="{owner}"}}'] for owner in ("demand", "read-ahead", "plan", "warm")}
    assert 0 < held["demand"] <= 8 * TEST_BLOCK_SIZE
    assert held["plan"] == held["warm"] == 0
    # The demand blocks kept are slots of the block buffer pool, which stays resident under them.
    assert 0 < metrics["cachefs_block_buffer_bytes"] <= metrics["cachefs_block_buffer_resident_bytes"]


def test_failures_are_counted_by_kind_and_operation(dataset: Path, tmp_path: Path) -> None:
    from hub_helpers import running_hub

    port = free_port()
    with running_hub(dataset) as hub:
        args = (*SPOKE_ARGS, "--fetch-timeout", "1", "--metrics-listen", f"127.0.0.1:{port}")
        with mounted_spoke(hub.url, tmp_path, args) as spoke:
            before = spoke_metrics(port)
            hub.stop()
            try:
                read_uncached(spoke.mountpoint / "shards/shard-001.bin", 0, 10)
            except OSError:
                pass
            metrics = spoke_metrics(port)
    # Exported at zero before the first failure, so that increase() over a
    # window sees that failure (the failed-read alerts rely on it).
    assert before['cachefs_fuse_errors_total{operation="read"}'] == 0
    assert before['cachefs_upstream_errors_total{kind="connection"}'] == 0
    assert before["cachefs_fetch_failures_total"] == 0
    assert metrics['cachefs_fuse_errors_total{operation="read"}'] >= 1
    assert metrics['cachefs_upstream_errors_total{kind="connection"}'] >= 1
    assert metrics["cachefs_fetch_failures_total"] >= 1
    # The spoke's counter of failed hub requests is in the spoke's namespace;
    # cachefs_hub_ is the hub's.
    assert not [name for name in {**before, **metrics} if name.startswith("cachefs_hub_")]


def resident_bytes(pid: int) -> int:
    kib = status_kib(pid, "VmRSS")
    assert kib is not None, f"no VmRSS in /proc/{pid}/status"
    return kib * 1024


def test_hub_and_spoke_export_process_metrics_and_no_created_series(hub, dataset: Path, tmp_path: Path) -> None:
    port = free_port()
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--metrics-listen", f"127.0.0.1:{port}")) as spoke:
        relative = "shards/shard-000.bin"
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()  # samples in every histogram
        spoke_text = metrics_text(f"http://127.0.0.1:{port}/metrics")
        assert spoke.pid is not None
        daemon_rss = resident_bytes(spoke.pid)
    hub_text = metrics_text(hub.url + "/metrics")
    hub_rss = resident_bytes(hub.proc.pid)
    for text, rss in [(spoke_text, daemon_rss), (hub_text, hub_rss)]:
        samples = parse_metrics(text)
        # The daemon's own process (not the CLI that mounted it), under the standard names.
        assert rss / 2 < samples["process_resident_memory_bytes"] < rss * 2
        assert samples["process_cpu_seconds_total"] > 0
        assert 0 < samples["process_open_fds"] < samples["process_max_fds"]
        assert "_created" not in text
        assert not [name for name in samples if name.startswith("cachefs_hub_process_")]
    assert parse_metrics(spoke_text)["cachefs_read_duration_seconds_count"] > 0


def test_readiness_is_reported_to_systemd(hub, tmp_path: Path) -> None:
    """With NOTIFY_SOCKET set (a Type=notify unit), the foreground daemon sends READY=1 once mounted."""
    notify_path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_path))
    receiver.settimeout(60)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    env = {**hub_env(), "NOTIFY_SOCKET": str(notify_path)}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "cachefs", "mount", hub.url, str(mountpoint), "--cache-dir", str(tmp_path / "c"),
         "--foreground", *SPOKE_ARGS],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        message = receiver.recv(1024)
        assert message == b"READY=1"
        assert (mountpoint / "with space.txt").read_text() == "a name with a space\n"
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        receiver.close()
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    assert daemon.returncode == 0


def test_a_metrics_port_in_use_is_one_line(hub, tmp_path: Path) -> None:
    """The metrics server is started inside the daemon's nursery: its error came out wrapped in
    an exception group, as an unexpected error with a traceback."""
    from mount_helpers import assert_clean_failure, run_cachefs

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        (tmp_path / "mnt").mkdir()
        result = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", *SPOKE_ARGS,
                             "--metrics-listen", f"127.0.0.1:{port}")
    assert_clean_failure(result, f"cannot serve metrics on 127.0.0.1:{port}: Address already in use")
    assert "Traceback" not in (tmp_path / "c" / "cachefs.log").read_text()
