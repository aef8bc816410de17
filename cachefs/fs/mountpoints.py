"""Mountpoint checks: what is mounted where (from /proc/self/mountinfo), stale FUSE mounts."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import subprocess
import threading
from pathlib import Path

from ..errors import UsageError

log = logging.getLogger(__name__)

FSTYPE = "fuse.cachefs"
# File systems whose files live on another machine: no place for a cache dir,
# whose index is a memory-mapped LMDB database (LMDB: "do not use on remote
# file systems") and whose reads should not cross a network again.
NETWORK_FSTYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "lustre", "gpfs", "beegfs",
    "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs",
    "fuse.cephfs", FSTYPE,
})


@dataclasses.dataclass(frozen=True, slots=True)
class MountInfo:
    mountpoint: str
    device: str  # "major:minor"
    fstype: str
    super_options: tuple[str, ...] = ()  # the file system's own (for FUSE: allow_other, ...)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return field.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "surrogateescape")


def list_mounts() -> list[MountInfo]:
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split()
            separator = fields.index("-")
            mounts.append(MountInfo(_unescape(fields[4]), fields[2], fields[separator + 1],
                                    tuple(fields[-1].split(","))))
    return mounts


def find_mount(path: Path) -> MountInfo | None:
    """The last (topmost) mount at exactly `path`, if any."""
    target = os.path.abspath(path)
    found = None
    for mount in list_mounts():
        if mount.mountpoint == target:
            found = mount
    return found


def mount_of(path: Path) -> MountInfo | None:
    """The mount that holds `path` (symlinks resolved): the topmost one at the longest mountpoint above it."""
    target = os.path.realpath(path)
    found = None
    for mount in list_mounts():
        inside = target == mount.mountpoint or target.startswith(mount.mountpoint.rstrip("/") + "/")
        if inside and (found is None or len(mount.mountpoint) >= len(found.mountpoint)):
            found = mount
    return found


def network_file_system(path: Path) -> str | None:
    """The type of the network file system that holds `path`, None if it is local (or unknown)."""
    mount = mount_of(path)
    return mount.fstype if mount is not None and mount.fstype in NETWORK_FSTYPES else None


def prepare_mountpoint(path: Path) -> Path:
    """Check that `path` can be mounted on; clean up a stale cachefs mount left by a crash."""
    path = Path(os.path.abspath(path))
    try:
        os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"mountpoint {path} does not exist") from None
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise UsageError(f"mountpoint {path} is not usable: {exc.strerror}") from None
        _clean_stale_mount(path)
    if not os.path.isdir(path):
        raise UsageError(f"mountpoint {path} is not a directory")
    mount = find_mount(path)
    if mount is not None:
        if mount.fstype == FSTYPE and _daemon_gone(path):
            _clean_stale_mount(path)
        else:
            raise UsageError(f"{path} is already a mountpoint ({mount.fstype}); unmount it first")
    return path


def _daemon_gone(path: Path, timeout_s: float = 5.0) -> bool:
    """True if a FUSE mount's daemon no longer answers (ENOTCONN).

    stat() alone can succeed on a dead mount from the kernel's attribute
    cache, so the probe lists the directory, which always asks the daemon.
    It runs in a thread so that a hung daemon cannot hang us.
    """
    outcome: list[bool] = []

    def probe() -> None:
        try:
            os.listdir(path)
            outcome.append(False)
        except OSError as exc:
            outcome.append(exc.errno == errno.ENOTCONN)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(outcome and outcome[0])


def _clean_stale_mount(path: Path) -> None:
    mount = find_mount(path)
    if mount is None or mount.fstype != FSTYPE:
        raise UsageError(f"mountpoint {path} is a disconnected mount that is not cachefs; unmount it first")
    log.warning("cleaning up stale cachefs mount on %s left by a daemon that died", path)
    lazy_unmount(path)


def lazy_unmount(path: Path) -> None:
    """Detach a mount even if busy or its daemon is gone."""
    subprocess.run(["fusermount3", "-u", "-z", str(path)], check=False, capture_output=True, timeout=30)
    if find_mount(path) is not None:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)
