"""Mistakes a user will make get one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SPOKE_ARGS
from hub_helpers import free_port, hub_env
from mount_helpers import SpokeMount, assert_clean_failure, daemon_pid, is_mounted, mounted_spoke, run_cachefs

import cachefs
from cachefs.fs.mountpoints import mount_of, network_file_system
from cachefs.processes import wait_for_pid


def test_hub_unreachable_at_mount(tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    started = time.monotonic()
    result = run_cachefs("mount", f"http://127.0.0.1:{free_port()}", tmp_path / "mnt", "--cache-dir", tmp_path / "c")
    assert_clean_failure(result, "cannot get the manifest", "127.0.0.1")
    assert time.monotonic() - started < 60
    assert not is_mounted(tmp_path / "mnt")


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("ftp://hub", "expected http"),
        ("http://", "no host"),
        ("not a url", "expected http"),
        ("http://h:99999", "invalid hub URL"),
        ("http://[::1:8470/?token=S3CRET", "invalid hub URL: Invalid IPv6 URL"),
    ],
)
def test_malformed_url(tmp_path: Path, url: str, fragment: str) -> None:
    (tmp_path / "mnt").mkdir()
    assert_clean_failure(run_cachefs("mount", url, tmp_path / "mnt", "--cache-dir", tmp_path / "c"), fragment)


def test_passthrough_is_refused_for_an_nfs_export(hub, tmp_path: Path) -> None:
    """An NFS export's handles of a file a refresh changed must fail; a file open in
    passthrough mode would read on in its old version."""
    (tmp_path / "mnt").mkdir()
    result = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", "--nfs-export", "--passthrough")
    assert_clean_failure(result, "--passthrough cannot be used with --nfs-export")
    assert not is_mounted(tmp_path / "mnt")


def test_mountpoint_missing_or_not_a_directory(hub, tmp_path: Path) -> None:
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "nope", "--cache-dir", tmp_path / "c"), "does not exist")
    (tmp_path / "file").write_text("x")
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "file", "--cache-dir", tmp_path / "c"), "not a directory")


def test_already_mounted(hub, tmp_path: Path) -> None:
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        result = run_cachefs("mount", hub.url, spoke.mountpoint, "--cache-dir", tmp_path / "other")
        assert_clean_failure(result, "already a mountpoint")


def test_cache_dir_in_use_by_another_daemon(hub, tmp_path: Path) -> None:
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        (tmp_path / "second").mkdir()
        result = run_cachefs("mount", hub.url, tmp_path / "second", "--cache-dir", spoke.cache_dir, *SPOKE_ARGS)
        assert_clean_failure(result, "in use by another cachefs daemon", str(spoke.pid))
        assert not is_mounted(tmp_path / "second")


def test_cache_dir_not_usable(hub, tmp_path: Path) -> None:
    (tmp_path / "mnt").mkdir()
    (tmp_path / "a-file").write_text("x")
    result = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "a-file")
    assert_clean_failure(result, "cache dir")
    result = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", "/proc/cachefs-cache")
    assert_clean_failure(result, "cannot create cache dir")
    result = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", "/sys/kernel")
    assert_clean_failure(result, "not writable")


def test_cache_dir_that_cannot_free_space(hub, tmp_path: Path, ramfs_dir: Path) -> None:
    """ramfs cannot punch holes: evicted blocks would keep their memory, so the mount is refused."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        result = run_cachefs("mount", hub.url, mountpoint, "--cache-dir", ramfs_dir / "cache")
        assert_clean_failure(result, "cannot free part of a file", "use a disk or tmpfs")
        assert not is_mounted(mountpoint)
    finally:
        if is_mounted(mountpoint):  # the test failed: leave nothing mounted on the ramfs
            run_cachefs("unmount", mountpoint)
    assert [path.name for path in ramfs_dir.joinpath("cache").iterdir()] == []  # no probe left behind


def test_cache_dir_on_a_network_file_system(hub, tmp_path: Path) -> None:
    """A cache dir inside another cachefs mount (a network file system, as NFS is) is refused before it is created."""
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        (tmp_path / "second").mkdir()
        cache_dir = spoke.mountpoint / "shards" / "cache"
        result = run_cachefs("mount", hub.url, tmp_path / "second", "--cache-dir", cache_dir, *SPOKE_ARGS)
        assert_clean_failure(result, f"cache dir {cache_dir} is on fuse.cachefs, a network file system")
        assert not is_mounted(tmp_path / "second")


def test_the_mount_of_a_path_is_the_deepest_one_above_it(tmp_path: Path, tmpfs_dir: Path) -> None:
    (tmp_path / "link").symlink_to(tmpfs_dir)
    assert mount_of(tmpfs_dir / "not" / "there").fstype == "tmpfs"
    assert mount_of(tmp_path / "link" / "cache").fstype == "tmpfs"  # symlinks resolved
    assert mount_of(tmp_path).fstype != "tmpfs"
    assert mount_of(Path("/proc/self")).fstype == "proc"
    assert network_file_system(tmpfs_dir) is None


@pytest.mark.parametrize(
    "option, value", [("--cache-size", "ten gigs"), ("--cache-size", "-5G"), ("--block-size", "1000"), ("--block-size", "1G")]
)
def test_invalid_sizes(hub, tmp_path: Path, option: str, value: str) -> None:
    assert_mount_refused(hub.url, tmp_path, f"{option}={value}", "invalid")


def assert_mount_refused(url: str, tmp_path: Path, option: str, *fragments: str) -> None:
    """`cachefs mount` with `option` fails cleanly; if it mounted after all, it is unmounted."""
    (tmp_path / "mnt").mkdir()
    try:
        assert_clean_failure(run_cachefs("mount", url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", option), *fragments)
    finally:
        if is_mounted(tmp_path / "mnt"):
            run_cachefs("umount", tmp_path / "mnt")


@pytest.mark.parametrize(
    "option, value",
    [("--fetch-timeout", "0"), ("--manifest-wait", "nan"), ("--refresh-interval", "-5"), ("--mount-timeout", "inf"),
     ("--mount-timeout", "1e12")],
)
def test_invalid_durations(hub, tmp_path: Path, option: str, value: str) -> None:
    """Before: nan passed every check and --manifest-wait nan ended the daemon with a ValueError;
    --mount-timeout 1e12 overflowed select() after the daemon had mounted."""
    assert_mount_refused(hub.url, tmp_path, f"{option}={value}", f"invalid {option} ", "a positive number of seconds")


def test_block_size_must_match_the_cache_dir(hub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS, cache_dir=cache_dir):
        pass
    (tmp_path / "mnt2").mkdir()
    result = run_cachefs("mount", hub.url, tmp_path / "mnt2", "--cache-dir", cache_dir, "--block-size", "1M")
    assert_clean_failure(result, "--block-size 65536")


def test_unmount_and_stats_of_something_not_mounted(tmp_path: Path) -> None:
    assert_clean_failure(run_cachefs("unmount", tmp_path), "is not mounted")
    assert_clean_failure(run_cachefs("stats", tmp_path), "is not mounted")
    assert_clean_failure(run_cachefs("stats", "/proc"), "not a cachefs mount")


def test_stale_mount_after_a_crash_is_cleaned_up(hub, tmp_path: Path, dataset: Path) -> None:
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        assert spoke.pid is not None
        os.kill(spoke.pid, signal.SIGKILL)
        for _ in range(100):
            try:
                os.kill(spoke.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with pytest.raises(OSError):
            os.stat(spoke.mountpoint)  # ENOTCONN: the daemon is gone
        result = run_cachefs("mount", hub.url, spoke.mountpoint, "--cache-dir", spoke.cache_dir, *SPOKE_ARGS)
        assert result.returncode == 0, result.stderr
        assert "stale" in result.stderr
        remounted = SpokeMount(spoke.mountpoint, spoke.cache_dir, daemon_pid(spoke.cache_dir))
        try:
            relative = "shards/shard-003.bin"
            assert (spoke.mountpoint / relative).read_bytes() == (dataset / relative).read_bytes()
        finally:
            remounted.unmount()


def test_help_describes_every_command() -> None:
    result = run_cachefs("--help")
    assert result.returncode == 0
    for command in ("mount", "unmount", "stats"):
        assert command in result.stdout
    mount_help = run_cachefs("mount", "--help").stdout
    for option in ("--cache-dir", "--cache-size", "--block-size", "--foreground", "--fetch-timeout"):
        assert option in mount_help


def test_cache_dir_whose_parent_is_missing_is_refused(hub, tmp_path: Path) -> None:
    """A missing parent is most often a cache disk that is not mounted: nothing is created on
    the disk under its mountpoint."""
    (tmp_path / "mnt").mkdir()
    cache_dir = tmp_path / "nvme" / "cachefs"
    result = run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", cache_dir)
    assert_clean_failure(result, f"cache dir {cache_dir}: {tmp_path / 'nvme'} does not exist", "is the cache disk mounted?")
    assert not (tmp_path / "nvme").exists()
    assert not is_mounted(tmp_path / "mnt")


@pytest.mark.parametrize("module, name", [("cachefs", "cachefs"), ("hubserver", "cachefs-hub")])
def test_both_commands_tell_their_version(module: str, name: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=30,
                            env=hub_env(), check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{name} {cachefs.__version__}\n"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--tier", "http://tier-0:8470", "--tier", "http://tier-0:8470"], "--tier http://tier-0:8470 is given twice"),
        (["--tier", "http://hub:8470"], "is the hub itself"),
        (["--tier", "ftp://tier-0"], "expected http"),
        (["--tier", "http://tier-0:8470", "--tier-slice", "1000K"], "invalid --tier-slice"),
    ],
)
def test_bad_tier_options(tmp_path: Path, args: list[str], fragment: str) -> None:
    (tmp_path / "mnt").mkdir()
    result = run_cachefs("mount", "http://hub:8470", tmp_path / "mnt", "--cache-dir", tmp_path / "c", *args)
    assert_clean_failure(result, fragment)


def test_a_token_to_tier_nodes_over_plain_http_is_warned_about(tmp_path: Path) -> None:
    """The token goes to the tier's nodes too (they pass it to the hub): each one over http is named."""
    token_file = tmp_path / "token"
    token_file.write_text("spoke-token-0123456789abcdef\n")
    token_file.chmod(0o600)
    (tmp_path / "mnt").mkdir()
    node = f"http://127.0.0.1:{free_port()}"
    result = run_cachefs("mount", "https://127.0.0.1:1", tmp_path / "mnt", "--cache-dir", tmp_path / "c",
                         "--token-file", token_file, "--tier", node, "--tier", "https://127.0.0.1:2")
    assert result.returncode != 0
    (warning,) = [line for line in result.stderr.splitlines() if "the hub token goes to" in line]
    assert f"goes to {node} unencrypted" in warning
    assert "spoke-token" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--fetch-timeout", "abc"], "cachefs mount: error: argument --fetch-timeout: invalid float value: 'abc'"),
    (["--max-connections", "many"], "cachefs mount: error: argument --max-connections: invalid int value: 'many'"),
    (["--no-such-option"], "cachefs: error: unrecognized arguments: --no-such-option (see cachefs --help)"),
])
def test_a_malformed_command_line_is_refused_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    """argparse's own errors too: one line (no usage block before it), exit code 2."""
    result = run_cachefs("mount", "http://hub:8470", tmp_path, "--cache-dir", tmp_path / "cache", *args)
    assert result.returncode == 2
    assert_clean_failure(result, message)


def test_commands_on_a_hung_daemon_fail_in_bounded_time_and_unmount_still_works(hub, tmp_path: Path) -> None:
    """A stopped (or hung) daemon never answers the stats attribute: `cachefs stats` and the
    other commands say so within the attribute's timeout, and `cachefs unmount` unmounts anyway."""
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        assert spoke.pid is not None
        os.kill(spoke.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert_clean_failure(run_cachefs("stats", spoke.mountpoint, timeout_s=30), "did not answer within")
            assert time.monotonic() - started < 20
            result = run_cachefs("unmount", spoke.mountpoint, timeout_s=30)
            assert result.returncode == 0, result.stderr
            assert "did not answer" in result.stdout
            assert not is_mounted(spoke.mountpoint)
        finally:
            os.kill(spoke.pid, signal.SIGCONT)
        assert wait_for_pid(spoke.pid, 15), "the daemon did not exit once it ran again"
