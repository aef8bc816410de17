"""Prometheus metrics of the spoke and systemd readiness, through their real interfaces."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from conftest import SPOKE_ARGS
from hub_helpers import hub_env
from mount_helpers import mounted_spoke, wait_for_stats
from test_mount import read_uncached


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_match_what_was_read(hub, dataset: Path, tmp_path: Path) -> None:
    port = free_port()
    with mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--metrics-listen", f"127.0.0.1:{port}")) as spoke:
        relative = "shards/shard-000.bin"
        size = (dataset / relative).stat().st_size
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        assert read_uncached(spoke.mountpoint / relative) == (dataset / relative).read_bytes()
        # Read-ahead may also have asked for the head of the next shard: all of it written.
        stats = wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == stats["fetched_bytes"] >= size)
        metrics = scrape(port)
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


def test_failures_are_counted_by_kind_and_operation(dataset: Path, tmp_path: Path) -> None:
    from hub_helpers import running_hub

    port = free_port()
    with running_hub(dataset) as hub:
        args = (*SPOKE_ARGS, "--fetch-timeout", "1", "--metrics-listen", f"127.0.0.1:{port}")
        with mounted_spoke(hub.url, tmp_path, args) as spoke:
            hub.stop()
            try:
                read_uncached(spoke.mountpoint / "shards/shard-001.bin", 0, 10)
            except OSError:
                pass
            metrics = scrape(port)
    assert metrics['cachefs_fuse_errors_total{operation="read"}'] >= 1
    assert metrics['cachefs_hub_errors_total{kind="connection"}'] >= 1
    assert metrics["cachefs_fetch_failures_total"] >= 1


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
