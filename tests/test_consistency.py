"""One snapshot per mount: a changed file never reads as a mix of versions; refresh moves on."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import shutil
import signal
import socket
import time
import urllib.request
from pathlib import Path

import lmdb
import pytest
from conftest import SPOKE_ARGS
from dataset import TEST_BLOCK_SIZE
from fault_proxy import running_fault_proxy
from hub_helpers import hub_health, running_hub, wait_for_generation_change, wait_until
from mount_helpers import cache_data_files, mounted_spoke, read_uncached, run_cachefs, wait_for_stats

from cachefs import plan as cachefs_plan

ARGS = (*SPOKE_ARGS, "--readahead-blocks", "0", "--prefetch-siblings", "0")


def test_changed_file_is_refused_not_mixed_and_refresh_moves_on(dataset: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    changed, unchanged = source / "shards/shard-001.bin", source / "shards/shard-000.bin"
    old_bytes = changed.read_bytes()
    with running_hub(source) as hub:
        generation_before = hub_health(hub)["generation"]
        with mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
            mounted_changed = spoke.mountpoint / "shards/shard-001.bin"
            mounted_unchanged = spoke.mountpoint / "shards/shard-000.bin"
            # Cache the first block of the file that will change, and all of the other.
            assert read_uncached(mounted_changed, 0, TEST_BLOCK_SIZE) == old_bytes[:TEST_BLOCK_SIZE]
            assert read_uncached(mounted_unchanged) == unchanged.read_bytes()

            new_bytes = os.urandom(len(old_bytes) + 5000)
            changed.write_bytes(new_bytes)

            # The mount still shows the old snapshot: cached blocks of it serve...
            assert read_uncached(mounted_changed, 0, TEST_BLOCK_SIZE) == old_bytes[:TEST_BLOCK_SIZE]
            # ...and uncached ones fail cleanly: the hub refuses bytes of another version.
            with pytest.raises(OSError) as failure:
                read_uncached(mounted_changed, 5 * TEST_BLOCK_SIZE, 100)
            assert failure.value.errno == errno.ESTALE
            with pytest.raises(OSError) as failure:  # a read across two blocks, both refused
                read_uncached(mounted_changed, 7 * TEST_BLOCK_SIZE - 4096, 8192)
            assert failure.value.errno == errno.ESTALE
            assert "changed on the hub" in spoke.log_text()
            assert "unexpected error" not in spoke.log_text()
            assert mounted_changed.stat().st_size == len(old_bytes)

            # The hub rescans on SIGUSR1 and publishes a new generation; refresh moves the mount to it.
            (source / "shards/shard-002.bin").unlink()
            hub.proc.send_signal(signal.SIGUSR1)
            wait_for_generation_change(hub, generation_before)
            with pytest.raises(OSError) as failure:  # until then, a file the rescan removed is refused alike
                read_uncached(spoke.mountpoint / "shards/shard-002.bin", 0, 100)
            assert failure.value.errno == errno.ESTALE
            fetched_before = spoke.stats()["fetched_bytes"]
            result = run_cachefs("refresh", spoke.mountpoint)
            assert result.returncode == 0, result.stderr
            assert "now shows generation" in result.stdout and "2 entries changed, 1 removed" in result.stdout
            assert mounted_changed.stat().st_size == len(new_bytes)
            assert read_uncached(mounted_changed) == new_bytes
            # The unchanged file kept its cached blocks.
            fetched = spoke.stats()["fetched_bytes"] - fetched_before
            assert read_uncached(mounted_unchanged) == unchanged.read_bytes()
            assert spoke.stats()["fetched_bytes"] - fetched_before == fetched
            again = run_cachefs("refresh", spoke.mountpoint)
            assert again.returncode == 0 and "already shows" in again.stdout


def test_a_changed_file_in_a_batch_fails_alone(dataset: Path, tmp_path: Path) -> None:
    """A batch of small files with one that changed on the hub (412): the others still read, that one is ESTALE."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    files = sorted((source / "small" / "dir 2").iterdir())
    changed = files[5]
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, (*SPOKE_ARGS, "--readahead-blocks", "0")) as spoke:
        changed.write_bytes(b"changed after the scan")
        for path in files:
            mounted = spoke.mountpoint / path.relative_to(source)
            if path == changed:
                with pytest.raises(OSError) as failure:
                    mounted.read_bytes()
                assert failure.value.errno == errno.ESTALE
            else:
                assert mounted.read_bytes() == path.read_bytes()
        stats = spoke.stats()
    assert "GET /v1/batch?" in hub.stderr_text() and '" 412 ' in hub.stderr_text()
    assert stats["block_misses"] <= 4  # the others came from prefetch (batched, then one by one), not on demand


def test_removed_and_added_files_after_refresh(dataset: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    with running_hub(source) as hub:
        with mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
            assert (spoke.mountpoint / "with space.txt").read_text() == "a name with a space\n"
            os.unlink(source / "with space.txt")
            (source / "new.txt").write_text("added later\n")
            request = urllib.request.Request(hub.url + "/v1/rescan", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                assert json.load(response)["rescanned"] is True
            assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
            assert not (spoke.mountpoint / "with space.txt").exists()
            assert (spoke.mountpoint / "new.txt").read_text() == "added later\n"
            assert "new.txt" in os.listdir(spoke.mountpoint)


def test_a_large_namespace_is_loaded_and_refreshed_in_a_child_process(tmp_path: Path) -> None:
    """A manifest over LOAD_IN_CHILD_MIN_BYTES is loaded by a child process (the memory LMDB
    keeps after a large write leaves with it): the mount shows it, and a refresh moves on."""
    source = tmp_path / "source"
    for directory in range(50):
        (source / f"d{directory:02d}").mkdir(parents=True)
        for index in range(1000):
            (source / f"d{directory:02d}" / f"sample-{index:05d}.jpg").touch()
    (source / "d00" / "sample-00000.jpg").write_bytes(b"first version")
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        assert (spoke.mountpoint / "d00" / "sample-00000.jpg").read_bytes() == b"first version"
        assert len(os.listdir(spoke.mountpoint / "d49")) == 1000
        shutil.rmtree(source / "d49")
        (source / "d00" / "sample-00000.jpg").write_bytes(b"second version")
        with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=60) as response:
            assert json.load(response)["rescanned"] is True
        result = run_cachefs("refresh", spoke.mountpoint)
        assert result.returncode == 0, result.stderr
        assert "1001 removed" in result.stdout, result.stdout
        assert not (spoke.mountpoint / "d49").exists()
        assert (spoke.mountpoint / "d00" / "sample-00000.jpg").read_bytes() == b"second version"
        assert list((spoke.cache_dir / "tmp").iterdir()) == []  # no manifest, answer or list of changes left
        loads = [line for line in spoke.log_text().splitlines() if "cachefs.namespace.loader INFO loaded manifest" in line]
    assert len(loads) == 2, loads  # the mount's and the refresh's


def test_a_slow_new_manifest_does_not_hold_up_a_mount_on_a_stored_snapshot(dataset: Path, tmp_path: Path) -> None:
    """With a snapshot in the cache dir, the mount waits --manifest-wait for the hub's new
    manifest, comes up on the stored one, and moves to the new one in the background
    (before: it waited for the whole download, past --mount-timeout on a slow link)."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    cache_dir = tmp_path / "cache"
    relative = "shards/shard-000.bin"
    with running_hub(source) as hub:
        with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
            assert (spoke.mountpoint / relative).read_bytes() == (source / relative).read_bytes()
        (source / "new.txt").write_text("added later\n")
        with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=60) as answer:
            assert json.load(answer)["rescanned"] is True
        with running_fault_proxy(hub.url, 0.0, manifest_delay_s=6.0) as slow:
            started = time.monotonic()
            with mounted_spoke(slow.url, tmp_path, (*ARGS, "--manifest-wait", "1"), cache_dir=cache_dir) as spoke:
                assert time.monotonic() - started < 5
                assert not (spoke.mountpoint / "new.txt").exists()  # the stored snapshot
                assert (spoke.mountpoint / relative).read_bytes() == (source / relative).read_bytes()
                assert wait_until(lambda: (spoke.mountpoint / "new.txt").exists(), timeout_s=30)
                assert (spoke.mountpoint / "new.txt").read_text() == "added later\n"
                assert "loading the new one once mounted" in spoke.log_text()
            assert slow.counts["delayed manifests"] == 2


def test_a_mount_that_loads_a_new_manifest_drops_the_blocks_of_older_versions(dataset: Path, tmp_path: Path) -> None:
    """Blocks of a version the snapshot no longer has are never read again: the mount that
    loads a new manifest drops them, as a refresh does (before: they stayed until evicted)."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    cache_dir = tmp_path / "cache"
    changed, kept = "shards/shard-001.bin", "shards/shard-000.bin"
    with running_hub(source) as hub:
        with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
            for relative in (changed, kept):
                assert (spoke.mountpoint / relative).read_bytes() == (source / relative).read_bytes()
            cached = wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == sum(
                (source / relative).stat().st_size for relative in (changed, kept)))["cached_bytes"]
        (source / changed).write_bytes(os.urandom(5000))
        with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=60) as answer:
            assert json.load(answer)["rescanned"] is True
        with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
            stats = wait_for_stats(spoke, lambda stats: stats["cached_bytes"] < cached)
            assert stats["cached_bytes"] == (source / kept).stat().st_size
            assert len(cache_data_files(cache_dir)) == 1
            assert (spoke.mountpoint / changed).read_bytes() == (source / changed).read_bytes()
            assert "cached blocks of file versions generation" in spoke.log_text()


def test_reads_that_fetch_and_cache_do_not_wait_for_a_namespace_load(tmp_path: Path) -> None:
    """A manifest's load holds the namespace's LMDB write lock for its whole transaction
    (tens of seconds at a million entries): meanwhile uncached reads are fetched and cached."""
    source = os.urandom(48 << 20)  # three times the fetched bytes that may wait for the cache's writer
    (tmp_path / "hub-data").mkdir()
    (tmp_path / "hub-data" / "big.bin").write_bytes(source)
    with running_hub(tmp_path / "hub-data") as hub, mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as spoke:
        env = lmdb.open(str(spoke.cache_dir / "namespace.lmdb"), max_dbs=16)
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool, env.begin(write=True):  # what a load holds
                reading = pool.submit(read_uncached, spoke.mountpoint / "big.bin")
                try:
                    read = reading.result(timeout=30)
                except concurrent.futures.TimeoutError:
                    pytest.fail("the read waited for the namespace's write lock")
                assert read == source
                wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == len(source))
        finally:
            env.close()


def test_a_handle_opened_before_a_refresh_never_feeds_its_bytes_to_newer_opens(dataset: Path, tmp_path: Path) -> None:
    """Both versions of a changed file share one kernel inode (and page cache): what a handle
    opened before the refresh reads after it must not be what an open of the new version is
    served, nor a later open once that handle is closed."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    relative = "shards/shard-001.bin"
    old_bytes = (source / relative).read_bytes()
    new_bytes = bytes(byte ^ 0xFF for byte in old_bytes)  # same size
    block = TEST_BLOCK_SIZE
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        path = spoke.mountpoint / relative
        old_handle = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(old_handle, block, 0) == old_bytes[:block]
            (source / "replacement").write_bytes(new_bytes)
            os.replace(source / "replacement", source / relative)
            with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=30):
                pass
            assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
            assert os.pread(old_handle, 2 * block, 0) == old_bytes[: 2 * block]  # it keeps its version
            new_handle = os.open(path, os.O_RDONLY)
            try:
                assert os.pread(new_handle, 3 * block, 0) == new_bytes[: 3 * block]
                assert os.pread(old_handle, block, 2 * block) == old_bytes[2 * block : 3 * block]
                assert os.pread(new_handle, block, 2 * block) == new_bytes[2 * block : 3 * block]
            finally:
                os.close(new_handle)
        finally:
            os.close(old_handle)
        assert path.read_bytes() == new_bytes  # and once the old handle is closed


def test_an_old_handle_read_to_its_end_leaves_new_opens_the_whole_longer_version(dataset: Path, tmp_path: Path) -> None:
    """A handle of the old version reading to its end gets a short read, which sets the kernel's
    size of the (shared) inode back to the old length: once it is closed, a stat and an open
    must see the new version's length, not the old one's for the attribute timeout (an hour)."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    relative = "shards/shard-001.bin"
    old_bytes = (source / relative).read_bytes()
    new_bytes = os.urandom(len(old_bytes) + 3 * TEST_BLOCK_SIZE)
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        path = spoke.mountpoint / relative
        old_handle = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(old_handle, len(old_bytes), 0) == old_bytes
            (source / "replacement").write_bytes(new_bytes)
            os.replace(source / "replacement", source / relative)
            with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=30):
                pass
            assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
            assert os.pread(old_handle, 2 * TEST_BLOCK_SIZE, len(old_bytes) - 100) == old_bytes[-100:]  # to its end
        finally:
            os.close(old_handle)
        assert wait_until(lambda: path.stat().st_size == len(new_bytes), 5)
        assert path.read_bytes() == new_bytes


def test_an_open_while_the_kernel_is_told_of_a_refresh_never_mixes_versions(tmp_path: Path) -> None:
    """The kernel is told what a refresh changed after the new generation is shown, one entry
    after another: an open of a changed file in between, of the new version, must not be
    served the old version's pages still in the kernel's cache (then the new one's after)."""
    source = tmp_path / "source"
    for directory in range(50):  # 50,000 changed entries: the kernel is told of the target last
        (source / f"d{directory:02d}").mkdir(parents=True)
        for index in range(1000):
            (source / f"d{directory:02d}" / f"sample-{index:05d}.jpg").touch()
    (source / "zz").mkdir()
    size = 4 * TEST_BLOCK_SIZE
    old, new = os.urandom(size), os.urandom(size)
    (source / "zz" / "target.bin").write_bytes(old)
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        path = spoke.mountpoint / "zz" / "target.bin"
        assert path.read_bytes() == old  # closed: its pages stay in the kernel's cache
        stamp = time.time() + 10
        for directory in range(50):
            for index in range(1000):
                os.utime(source / f"d{directory:02d}" / f"sample-{index:05d}.jpg", (stamp, stamp))
        (source / "replacement").write_bytes(new)
        os.replace(source / "replacement", source / "zz" / "target.bin")
        before = hub_health(hub)["generation"]
        hub.proc.send_signal(signal.SIGUSR1)
        wait_for_generation_change(hub, before)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            refresh = pool.submit(run_cachefs, "refresh", spoke.mountpoint)
            while json.loads(os.getxattr(spoke.mountpoint, "user.cachefs.stats"))["generation"] == before:
                assert not refresh.done(), refresh.result().stderr
                time.sleep(0.001)
            fd = os.open(path, os.O_RDONLY)  # the new generation is shown: an open of the new version
            try:
                first = os.pread(fd, size // 2, 0)
                assert refresh.result(60).returncode == 0
                second = os.pread(fd, size // 2, size // 2)
            finally:
                os.close(fd)
    assert first + second == new


def test_a_handle_opened_before_a_refresh_keeps_reading_its_cached_blocks(dataset: Path, tmp_path: Path) -> None:
    """The refresh drops the cached blocks of older versions, but not of one still open: its
    handle reads them after the kernel's pages are gone (before: ESTALE, the hub has only the
    new version); they go at the next mount."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    relative = "shards/shard-000.bin"
    old_bytes = (source / relative).read_bytes()
    block = TEST_BLOCK_SIZE
    cache_dir = tmp_path / "cache"
    with running_hub(source) as hub:
        with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:
            path = spoke.mountpoint / relative
            old_handle = os.open(path, os.O_RDONLY)
            try:
                # All of it, so that the first blocks are no longer among the reader's recent ones in memory.
                assert os.pread(old_handle, len(old_bytes), 0) == old_bytes
                wait_for_stats(spoke, lambda stats: stats["cached_bytes"] >= len(old_bytes))
                (source / "replacement").write_bytes(os.urandom(len(old_bytes)))
                os.replace(source / "replacement", source / relative)
                with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=30):
                    pass
                assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
                os.posix_fadvise(old_handle, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel's copy goes
                hits = spoke.stats()["block_hits"]
                assert os.pread(old_handle, block, 5 * block) == old_bytes[5 * block : 6 * block]
                assert spoke.stats()["block_hits"] > hits  # the daemon served it, from its cache
                assert "kept the cached blocks of 1 older file versions still open" in spoke.log_text()
            finally:
                os.close(old_handle)
        with mounted_spoke(hub.url, tmp_path, ARGS, cache_dir=cache_dir) as spoke:  # the next mount drops them
            wait_for_stats(spoke, lambda stats: stats["cached_bytes"] == 0)
            assert (spoke.mountpoint / relative).read_bytes() == (source / relative).read_bytes()


def test_a_refresh_shows_names_looked_up_before_and_paths_that_changed_kind(dataset: Path, tmp_path: Path) -> None:
    """The kernel caches "no such file" (the snapshot cannot change) and a path's kind with its
    inode number (a hash of the path): a refresh makes it forget both for what it changes."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        added, retyped = spoke.mountpoint / "added.txt", spoke.mountpoint / "with space.txt"
        assert not added.exists() and retyped.is_file()  # both now in the kernel's caches
        (source / "added.txt").write_text("added later\n")
        (source / "with space.txt").unlink()
        (source / "with space.txt").mkdir()
        (source / "with space.txt" / "inner").write_text("inner\n")
        with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=30):
            pass
        assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
        assert added.read_text() == "added later\n"
        assert retyped.is_dir() and (retyped / "inner").read_text() == "inner\n"


def test_refresh_interval_follows_the_hub(dataset: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, (*ARGS, "--refresh-interval", "0.5")) as spoke:
        assert (spoke.mountpoint / "with space.txt").read_text() == "a name with a space\n"
        (source / "with space.txt").write_text("changed at the hub\n")
        with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=30):
            pass
        deadline = time.monotonic() + 30
        while (spoke.mountpoint / "with space.txt").stat().st_size != len("changed at the hub\n"):
            assert time.monotonic() < deadline, "the mount did not follow the hub's new generation"
            time.sleep(0.1)
        assert (spoke.mountpoint / "with space.txt").read_text() == "changed at the hub\n"


def test_a_new_snapshot_cancels_plans_also_one_still_being_sent(dataset: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    shard = "shards/shard-000.bin"
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, ARGS) as spoke:
        active = cachefs_plan.submit([(spoke.mountpoint / shard, 0, 100)], epoch=1)
        sending = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sending.settimeout(30)
        try:
            sending.connect(str(spoke.cache_dir / cachefs_plan.SOCKET_NAME))
            for line in ({"command": "plan", "epoch": 2}, {"files": [shard]}, {"reads": [[0, 0, 100]]}):
                sending.sendall(json.dumps(line).encode() + b"\n")  # no end marker yet
            wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 2)
            (source / "new.txt").write_text("added later\n")
            request = urllib.request.Request(hub.url + "/v1/rescan", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                assert json.load(response)["rescanned"] is True
            assert run_cachefs("refresh", spoke.mountpoint).returncode == 0
            wait_for_stats(spoke, lambda s: s["training"]["plans_active"] == 0)
            # The plan being sent is refused at its next line, with a reason, and nothing of it is kept.
            sending.sendall(json.dumps({"reads": [[0, 100, 100]]}).encode() + b"\n")
            with sending.makefile("rb") as replies:
                reply = json.loads(replies.readline())
            assert reply["ok"] is False and "cancelled while it was being sent" in reply["error"], reply
        finally:
            sending.close()
            active.close()
        plans_dir = spoke.cache_dir / "plans"
        assert not plans_dir.exists() or not any(plans_dir.iterdir())
        assert spoke.stats()["training"]["plans_active"] == 0
