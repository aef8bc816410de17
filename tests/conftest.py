"""Shared fixtures: a generated dataset, a real hub on loopback, real FUSE mounts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from dataset import TEST_BLOCK_SIZE, make_dataset  # noqa: E402
from hub_helpers import HubProcess, running_hub  # noqa: E402
from mount_helpers import SpokeMount, mounted_spoke  # noqa: E402

SPOKE_ARGS = ("--block-size", str(TEST_BLOCK_SIZE), "--fetch-timeout", "5")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("source") / "data")


@pytest.fixture(scope="session")
def hub(dataset: Path) -> Iterator[HubProcess]:
    """One hub for the tests that never stop it."""
    with running_hub(dataset) as process:
        yield process


@pytest.fixture
def spoke(hub: HubProcess, tmp_path: Path) -> Iterator[SpokeMount]:
    """A fresh mount with an empty cache, 64 KiB blocks."""
    with mounted_spoke(hub.url, tmp_path, SPOKE_ARGS) as mount:
        yield mount


@contextlib.contextmanager
def mounted_memory_fs(kind: str, mountpoint: Path) -> Iterator[Path]:
    """A ramfs or tmpfs mounted on `mountpoint` (needs root, as CI has), unmounted after."""
    if os.geteuid() != 0:
        pytest.fail(f"mounting a {kind} needs root")
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", kind, kind, str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


@pytest.fixture
def ramfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A ramfs: refuses O_DIRECT, RWF_NOWAIT reads and punching holes."""
    with mounted_memory_fs("ramfs", tmp_path / "ramfs") as mountpoint:
        yield mountpoint


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs: refuses RWF_NOWAIT reads (Linux 6.18), punches holes."""
    with mounted_memory_fs("tmpfs", tmp_path / "tmpfs") as mountpoint:
        yield mountpoint
