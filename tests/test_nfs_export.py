"""`cachefs export`: NFS-Ganesha serving a real spoke mount read-only, read by a real
user-space NFS client (libnfs: nfs-ls, nfs-cat and tests/nfs_client.py)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SPOKE_ARGS
from dataset import source_files
from hub_helpers import REPO_ROOT, HubProcess, running_hub, sample, scrape_metrics
from mount_helpers import SpokeMount, mount_spoke, mounted_spoke, run_cachefs
from nfs_helpers import idle_nfs_client, nfs_namespace
from systemd_helpers import unit_privileges

# allow_other: Ganesha reads as each client's user. No sibling prefetch: a read
# fetches only the file read, so the bytes fetched can be counted.
NFS_SPOKE_ARGS = (*SPOKE_ARGS, "--allow-other", "--nfs-export", "--prefetch-siblings", "0")
NFS_UNIT = REPO_ROOT / "deploy" / "systemd" / "cachefs-nfs@.service"


def _source_tree(root: Path) -> set[tuple[bytes, str, int]]:
    """(path below root, kind, size) of every entry, as `nfs-ls -R` lists them."""
    entries = set()
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            info = path.lstat()
            kind = "d" if stat.S_ISDIR(info.st_mode) else "l" if stat.S_ISLNK(info.st_mode) else "-"
            size = 0 if kind == "d" else info.st_size
            entries.add((os.fsencode(path.relative_to(root)), kind, size))
    return entries


def _nfs_ls_tree(output: bytes) -> set[tuple[bytes, str, int]]:
    """Parse `nfs-ls -R`: "MODE NLINK UID GID SIZE PATH" lines, PATH with a leading '/'."""
    entries = set()
    for line in output.splitlines():
        mode, _nlink, _uid, _gid, size, path = line.split(maxsplit=5)
        kind = mode[:1].decode()
        entries.add((path.lstrip(b"/"), kind, 0 if kind == "d" else int(size)))
    return entries


def test_the_export_serves_the_hubs_tree_and_every_byte(dataset: Path, hub: HubProcess, tmp_path: Path) -> None:
    """NFSv4 lists the same tree as the hub's dataset (names that are not UTF-8, symlinks,
    empty dirs), and NFSv3 reads every file byte for byte, with the privileges the export's
    unit grants (CapabilityBoundingSet=, NoNewPrivileges=, MemoryDenyWriteExecute=)."""
    with mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke, nfs_namespace(tmp_path) as ns:
        ns.start_ganesha(spoke.mountpoint, "--pseudo", "/data", wrapper=unit_privileges(NFS_UNIT))
        listing = ns.run(["nfs-ls", "-R", "nfs://127.0.0.1/data/?version=4"])
        assert listing.returncode == 0, listing.stderr
        assert _nfs_ls_tree(listing.stdout) == _source_tree(dataset)
        with idle_nfs_client(ns, str(spoke.mountpoint), version=3) as client:
            for relative in source_files(dataset):
                answer = client.ask(op="sha256", path="/" + os.fsdecode(relative))
                expected = (dataset / relative).read_bytes()
                assert answer == {"ok": True, "sha256": hashlib.sha256(expected).hexdigest(), "size": len(expected)}, relative


def test_an_uncached_file_read_over_nfs_crosses_from_the_hub_once(dataset: Path, hub: HubProcess, tmp_path: Path) -> None:
    """Two NFS reads of a file the cache does not hold: the hub sends its bytes once.
    (A file followed by a small one: near the end of a large file, read-ahead asks
    for the head of the next large file, which the hub would send too.)"""
    relative = "shards/shard-001.bin"
    expected = (dataset / relative).read_bytes()
    with mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke, nfs_namespace(tmp_path) as ns:
        ns.start_ganesha(spoke.mountpoint)
        sent_before = sample(scrape_metrics(hub), "cachefs_hub_sent_bytes_total", endpoint="files")
        for version in (3, 4):
            url = f"nfs://127.0.0.1{spoke.mountpoint}/{relative}?version={version}"
            result = ns.run(["nfs-cat", url])
            assert result.returncode == 0, result.stderr
            assert result.stdout == expected
        sent = sample(scrape_metrics(hub), "cachefs_hub_sent_bytes_total", endpoint="files") - sent_before
        assert spoke.stats()["fetched_bytes"] == len(expected)
        assert sent == len(expected)


def _rewrite_and_refresh(hub: HubProcess, spoke: SpokeMount, path: Path, content: bytes) -> None:
    """A new version of one file at the hub, and the spoke refreshed onto it."""
    path.write_bytes(content)
    with urllib.request.urlopen(urllib.request.Request(hub.url + "/v1/rescan", method="POST"), timeout=60) as answer:
        assert json.load(answer)["rescanned"] is True
    result = run_cachefs("refresh", spoke.mountpoint)
    assert result.returncode == 0, result.stderr


def test_idle_nfs_handles_survive_a_server_restart_and_only_removed_files_turn_stale(dataset: Path, tmp_path: Path) -> None:
    """File handles an NFSv3 client holds keep reading after Ganesha restarts (they name the
    spoke's stable inodes), and after a snapshot refresh: ESTALE for the file removed, an
    error and then never the old bytes for the file changed (a path lookup gets the new
    ones), the same bytes for the others."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    kept, removed, changed = "shards/shard-001.bin", "small/dir 0/file-00.dat", "with space.txt"
    kept_bytes = (source / kept).read_bytes()
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke, nfs_namespace(tmp_path) as ns:
        server = ns.start_ganesha(spoke.mountpoint)
        with idle_nfs_client(ns, str(spoke.mountpoint), version=3) as client:
            handles = {path: client.open("/" + path) for path in (kept, removed, changed)}
            assert client.read(handles[kept], 0, 4096) == kept_bytes[:4096]
            assert client.read(handles[removed], 0, 10) == (source / removed).read_bytes()[:10]
            assert client.read(handles[changed], 0, 4096) == (source / changed).read_bytes()

            ns.stop_ganesha(server)
            server = ns.start_ganesha(spoke.mountpoint)
            assert client.read(handles[kept], 1 << 20, 4096) == kept_bytes[1 << 20 : (1 << 20) + 4096]
            old_bytes = (source / changed).read_bytes()
            assert client.read(handles[changed], 0, 4096) == old_bytes  # Ganesha now holds it open

            (source / removed).unlink()
            new_bytes = b"a second version, longer than the first one was\n"
            _rewrite_and_refresh(hub, spoke, source / changed, new_bytes)

            assert client.size(handles[removed]) == -errno.ESTALE
            # The server held the old version open: its handle fails rather than read on in it.
            assert isinstance(client.read(handles[changed], 0, 4096), int)
            for _ in range(2):  # and then never serves the old bytes, nor the new ones under the old size
                size, data = client.size(handles[changed]), client.read(handles[changed], 0, 4096)
                assert size == -errno.ESTALE and isinstance(data, int), (size, data)
            result = ns.run(["nfs-cat", f"nfs://127.0.0.1{spoke.mountpoint}/{changed}?version=3"])
            assert result.stdout == new_bytes, result.stderr
            assert client.read(handles[kept], 0, 4096) == kept_bytes[:4096]


def test_a_fresh_lookup_after_a_refresh_reads_the_new_version_of_a_file_ganesha_holds_open(dataset: Path, tmp_path: Path) -> None:
    """A client read a file before a refresh changed it, so Ganesha holds its old version
    open. Another client's first lookup and read after the refresh get the new bytes; the
    first client's handle never reads the old ones. A file the refresh added to a
    directory Ganesha has listed is found at once."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    changed, added = "with space.txt", "small/dir 0/added.dat"
    old_bytes, new_bytes = (source / changed).read_bytes(), b"a second version, longer than the first one was\n"
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke, nfs_namespace(tmp_path) as ns:
        ns.start_ganesha(spoke.mountpoint)
        listing = ns.run(["nfs-ls", "-R", f"nfs://127.0.0.1{spoke.mountpoint}/?version=3"])
        assert listing.returncode == 0 and b"added.dat" not in listing.stdout, listing.stderr
        with idle_nfs_client(ns, str(spoke.mountpoint), version=3) as client:
            held = client.open("/" + changed)
            assert client.read(held, 0, 4096) == old_bytes
            (source / added).write_bytes(b"added by the refresh\n")
            _rewrite_and_refresh(hub, spoke, source / changed, new_bytes)
            result = ns.run(["nfs-cat", f"nfs://127.0.0.1{spoke.mountpoint}/{added}?version=3"])
            assert (result.returncode, result.stdout) == (0, b"added by the refresh\n"), result.stderr
            for version in (3, 4):
                result = ns.run(["nfs-cat", f"nfs://127.0.0.1{spoke.mountpoint}/{changed}?version={version}"])
                assert (result.returncode, result.stdout) == (0, new_bytes), result.stderr
            assert client.read(client.open("/" + changed), 0, 4096) == new_bytes
            for _ in range(2):  # the old version's handle no longer reads (its attributes may be Ganesha's cached ones)
                size, data = client.size(held), client.read(held, 0, 4096)
                assert size in (len(old_bytes), -errno.ESTALE) and isinstance(data, int), (size, data)


def _assert_stale(call: Callable[[], object]) -> None:
    with pytest.raises(OSError) as stale:
        call()
    assert stale.value.errno == errno.ESTALE


def test_a_kernel_handle_of_a_version_a_refresh_replaced_is_stale(tmp_path: Path, dataset: Path) -> None:
    """The spoke's half of the above. After a refresh, a handle the kernel made of the old
    version (what Ganesha holds) fails with ESTALE, and so does a stat of a file opened
    before: while the kernel still holds the old version's inode (the daemon refuses it),
    and once the path was looked up again (the kernel sees the new generation). The
    path's new handle opens the new version."""
    source = tmp_path / "source"
    shutil.copytree(dataset, source, symlinks=True)
    changed, new_bytes = "with space.txt", b"the second version\n"
    with running_hub(source) as hub, mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke:
        old_handle = _name_to_handle(spoke.mountpoint / changed)
        with open(spoke.mountpoint / changed, "rb") as before:
            assert before.read() == (source / changed).read_bytes()
            _rewrite_and_refresh(hub, spoke, source / changed, new_bytes)
            _assert_stale(lambda: os.fstat(before.fileno()))
            _assert_stale(lambda: os.close(_open_by_handle(spoke.mountpoint, old_handle)))
        assert (spoke.mountpoint / changed).read_bytes() == new_bytes
        _assert_stale(lambda: os.close(_open_by_handle(spoke.mountpoint, old_handle)))
        with os.fdopen(_open_by_handle(spoke.mountpoint, _name_to_handle(spoke.mountpoint / changed)), "rb") as after:
            assert after.read() == new_bytes


@contextlib.contextmanager
def _holding_device_number(device: int, workdir: Path, timeout_s: float = 10.0) -> Iterator[None]:
    """tmpfs mounts until one has `device` (the kernel hands out the lowest free anonymous
    device number; an unmounted file system may free its number a little later), unmounted
    after the block. Best effort: tests running beside this one mount file systems too and
    may take the number first, which serves the purpose as well."""
    mounts: list[Path] = []
    deadline = time.monotonic() + timeout_s
    try:
        while (not mounts or os.stat(mounts[-1]).st_dev != device) and time.monotonic() < deadline:
            if len(mounts) == 64:  # numbers below it are free again, or it is not yet
                _unmount_all(mounts)
                time.sleep(0.2)
            path = workdir / f"tmpfs-{len(mounts)}"
            path.mkdir(exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(path)], check=True)
            mounts.append(path)
        yield
    finally:
        _unmount_all(mounts)


def _unmount_all(mounts: list[Path]) -> None:
    while mounts:
        subprocess.run(["umount", str(mounts.pop())], check=False)


def test_idle_nfs_handles_survive_a_spoke_restart_on_a_new_device_number(dataset: Path, hub: HubProcess, tmp_path: Path) -> None:
    """The spoke unmounts and mounts again (same cache dir) while an NFSv3 client holds a
    file's handle and the export's root handle; the new mount gets another device number
    (the old one is taken meanwhile). After Ganesha restarts on it, the handles work."""
    kept = "shards/shard-001.bin"
    kept_bytes = (dataset / kept).read_bytes()
    with mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke, nfs_namespace(tmp_path) as ns:
        server = ns.start_ganesha(spoke.mountpoint)
        with idle_nfs_client(ns, str(spoke.mountpoint), version=3) as client:
            file = client.open("/" + kept)
            assert client.read(file, 0, 4096) == kept_bytes[:4096]
            device = os.stat(spoke.mountpoint).st_dev
            ns.stop_ganesha(server)
            spoke.unmount()
            for _attempt in range(3):  # until the new mount really has another device number
                with _holding_device_number(device, tmp_path):
                    spoke = mount_spoke(hub.url, spoke.mountpoint, spoke.cache_dir, NFS_SPOKE_ARGS)
                if os.stat(spoke.mountpoint).st_dev != device:
                    break
                spoke.unmount()
            assert os.stat(spoke.mountpoint).st_dev != device
            ns.start_ganesha(spoke.mountpoint)
            assert client.size(file) == len(kept_bytes)
            assert client.read(file, 1 << 20, 4096) == kept_bytes[1 << 20 : (1 << 20) + 4096]
            assert client.ask(op="sha256", path="/a/b/c/d/leaf.txt")["ok"]  # looked up from the root's handle


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 128)]


_libc = ctypes.CDLL(None, use_errno=True)


def _name_to_handle(path: Path) -> _FileHandle:
    handle, mount_id = _FileHandle(handle_bytes=128), ctypes.c_int()
    if _libc.name_to_handle_at(-100, os.fsencode(path), ctypes.byref(handle), ctypes.byref(mount_id), 0) != 0:
        raise OSError(ctypes.get_errno(), f"name_to_handle_at {path}")
    return handle


def _open_by_handle(mountpoint: Path, handle: _FileHandle) -> int:
    mount_fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = _libc.open_by_handle_at(mount_fd, ctypes.byref(handle), os.O_RDONLY)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "open_by_handle_at")
        return fd
    finally:
        os.close(mount_fd)


def test_kernel_file_handles_of_the_mount_survive_a_spoke_restart(dataset: Path, hub: HubProcess, tmp_path: Path) -> None:
    """The spoke's half of an NFS export: a handle the kernel made (what an NFS server hands
    out) opens the same file on the next mount of the same cache dir, through lookups of
    "." and ".." by inode number; a handle of an inode the snapshot lacks is stale."""
    relatives = ["shards/shard-002.bin", "a/b/c/d/leaf.txt", "small/dir 3/file-24.dat"]
    with mounted_spoke(hub.url, tmp_path, NFS_SPOKE_ARGS) as spoke:
        handles = {relative: _name_to_handle(spoke.mountpoint / relative) for relative in relatives}
        directory_handle = _name_to_handle(spoke.mountpoint / "a" / "b")
    spoke = mount_spoke(hub.url, spoke.mountpoint, spoke.cache_dir, NFS_SPOKE_ARGS)
    try:
        for relative, handle in handles.items():
            fd = _open_by_handle(spoke.mountpoint, handle)
            with os.fdopen(fd, "rb") as reopened:
                assert reopened.read() == (dataset / relative).read_bytes(), relative
        fd = _open_by_handle(spoke.mountpoint, directory_handle)
        try:
            assert sorted(os.listdir(fd)) == ["c"]
            assert os.stat("..", dir_fd=fd).st_ino == os.stat(spoke.mountpoint / "a").st_ino  # ".." looked up
        finally:
            os.close(fd)
        unknown = _FileHandle.from_buffer_copy(handles[relatives[0]])
        unknown.f_handle[0] ^= 0xFF  # another inode number: no entry of the snapshot
        try:
            os.close(_open_by_handle(spoke.mountpoint, unknown))
            raise AssertionError("a handle of no entry opened")
        except OSError as exc:
            assert exc.errno == errno.ESTALE
    finally:
        spoke.unmount()


def test_export_refuses_what_it_cannot_serve_with_one_line(spoke: SpokeMount, tmp_path: Path) -> None:
    """Not a cachefs mount, a mount without --allow-other (Ganesha reads as each client's
    user), a client that is no address: one line each, no traceback, nothing started."""
    cases = [
        ([str(tmp_path), "--clients", "*"], "is not mounted"),
        ([str(spoke.mountpoint), "--clients", "*"], "without --allow-other"),
    ]
    for args, message in cases:
        result = run_cachefs("export", *args)
        assert result.returncode == 1 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    with mounted_spoke(spoke_url(spoke), tmp_path, NFS_SPOKE_ARGS, name="exported mount") as exported:  # a space too
        result = run_cachefs("export", exported.mountpoint, "--clients", "10.0.0.0/8,node-7")
        assert result.returncode == 1 and "invalid client 'node-7'" in result.stderr, result.stderr
        result = run_cachefs("export", exported.mountpoint, "--clients", "10.0.0.0/255.0.0.0")  # Ganesha drops netmasks
        assert result.returncode == 1 and "invalid client '10.0.0.0/255.0.0.0'" in result.stderr, result.stderr
        for bind in ("0.0.0.0; }", "::1"):  # Ganesha 4.3 exits on an IPv6 Bind_Addr
            result = run_cachefs("export", exported.mountpoint, "--clients", "*", "--bind", bind)
            assert result.returncode == 1 and "invalid --bind" in result.stderr, result.stderr
        result = run_cachefs("export", exported.mountpoint, "--clients", "10.0.0.0/8", "--pseudo", "/data")
        assert result.returncode == 0, result.stderr
        assert f'Path = "{exported.mountpoint}";' in result.stdout and 'Pseudo = "/data";' in result.stdout
        assert "CLIENT { Clients = 10.0.0.0/8; Access_Type = RO; }" in result.stdout


def spoke_url(spoke: SpokeMount) -> str:
    return str(spoke.stats()["hub_url"])


def test_systemd_unit_of_the_export_verifies_clean(tmp_path: Path) -> None:
    """deploy/systemd/cachefs-nfs@.service, beside the mount's unit it binds to, passes systemd-analyze verify."""
    cachefs = str(Path(sys.executable).parent / "cachefs")
    assert os.path.exists(cachefs), "cachefs is not installed in this environment (pip install -e .)"
    for unit in ("cachefs@.service", "cachefs-nfs@.service"):
        text = (REPO_ROOT / "deploy" / "systemd" / unit).read_text().replace("/opt/cachefs/bin/cachefs", cachefs)
        (tmp_path / unit).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(tmp_path / "cachefs-nfs@mnt-data.service")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
