"""--uid, --gid, --file-mode, --dir-mode: who the mount's files belong to, checked by the
kernel (default_permissions) for a real non-root reader; and the hub as the mount's source."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from conftest import SPOKE_ARGS
from hub_helpers import HubProcess, running_hub
from mount_helpers import SpokeMount, assert_clean_failure, mounted_spoke, run_cachefs

# A group the reader is in and root's files are not: a number needs no entry in /etc/group.
READERS_GID = 4242
SECRET = b"rows only the readers group may see\n"


@pytest.fixture(scope="module")
def private_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset of mode 0640 files in 0750 directories, owned by root."""
    root = tmp_path_factory.mktemp("private") / "data"
    (root / "train").mkdir(parents=True)
    (root / "train" / "part-0.bin").write_bytes(SECRET)
    (root / "train").chmod(0o750)
    (root / "train" / "part-0.bin").chmod(0o640)
    return root


@pytest.fixture(scope="module")
def private_hub(private_dataset: Path) -> Iterator[HubProcess]:
    with running_hub(private_dataset) as hub:
        yield hub


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory other users can reach (pytest's temp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-owner-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def read_as_reader(path: Path) -> subprocess.CompletedProcess[bytes]:
    """`cat path` as user nobody in group READERS_GID (and no other group)."""
    return subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", f"--groups={READERS_GID}", "cat", str(path)],
        capture_output=True, timeout=30, check=False,
    )


def mount(hub: HubProcess, public_dir: Path, tmp_path: Path, *options: str) -> AbstractContextManager[SpokeMount]:
    return mounted_spoke(hub.url, public_dir, (*SPOKE_ARGS, *options), cache_dir=tmp_path / "cache")


@pytest.mark.skipif(os.geteuid() != 0, reason="a reader of another uid needs root to switch to it")
def test_a_group_member_reads_a_0640_dataset_only_through_gid(
    private_hub: HubProcess, public_dir: Path, tmp_path: Path
) -> None:
    with mount(private_hub, public_dir, tmp_path, "--allow-other", "--gid", str(READERS_GID)) as spoke:
        member = read_as_reader(spoke.mountpoint / "train" / "part-0.bin")
        assert member.returncode == 0, member.stderr
        assert member.stdout == SECRET
        info = (spoke.mountpoint / "train" / "part-0.bin").stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, READERS_GID, 0o640)
    with mount(private_hub, public_dir, tmp_path, "--allow-other") as spoke:
        refused = read_as_reader(spoke.mountpoint / "train" / "part-0.bin")
        assert refused.returncode != 0 and b"Permission denied" in refused.stderr
        assert (spoke.mountpoint / "train" / "part-0.bin").stat().st_gid == 0


def test_modes_and_owner_replace_the_hubs(private_hub: HubProcess, public_dir: Path, tmp_path: Path) -> None:
    options = ("--uid", "nobody", "--gid", "0", "--file-mode", "0444", "--dir-mode", "555")
    with mount(private_hub, public_dir, tmp_path, *options) as spoke:
        nobody = int(subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True, check=True).stdout)
        for path, mode in [(spoke.mountpoint, 0o555), (spoke.mountpoint / "train", 0o555),
                           (spoke.mountpoint / "train" / "part-0.bin", 0o444)]:
            info = path.stat()
            assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (nobody, 0, mode), path
        assert (spoke.mountpoint / "train" / "part-0.bin").read_bytes() == SECRET


def test_the_hub_is_the_mounts_source(spoke: SpokeMount, hub: HubProcess) -> None:
    """findmnt and df name the hub the mount reads from, not just "cachefs"."""
    result = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--mountpoint", str(spoke.mountpoint)],
        capture_output=True, text=True, timeout=30, check=True,
    )
    assert result.stdout.split() == [hub.url, "fuse.cachefs"]


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--uid", "no-such-user-here", "unknown user 'no-such-user-here'"),
        ("--gid", "no-such-group-here", "unknown group 'no-such-group-here'"),
        ("--file-mode", "0999", "invalid mode '0999'"),
        ("--dir-mode", "rwxr-x---", "invalid mode 'rwxr-x---'"),
    ],
)
def test_bad_ownership_options_are_one_line(hub: HubProcess, tmp_path: Path, option: str, value: str, message: str) -> None:
    (tmp_path / "mnt").mkdir()
    assert_clean_failure(run_cachefs("mount", hub.url, tmp_path / "mnt", "--cache-dir", tmp_path / "c", option, value), message)
