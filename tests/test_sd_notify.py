"""Type=notify for both units: the hub and a --foreground spoke send READY=1 to
$NOTIFY_SOCKET, a real unix datagram socket here, once they serve, and STOPPING=1
when they stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SPOKE_ARGS
from hub_helpers import HubProcess, hub_command, hub_env
from mount_helpers import SpokeMount, cachefs_command, daemon_pid, is_mounted

NOTIFY_TIMEOUT_S = 30.0


@contextlib.contextmanager
def notify_socket(path: Path | None) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket and the $NOTIFY_SOCKET value naming it ("@..." for the abstract namespace)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        if path is None:
            name = f"cachefs-test-notify-{os.getpid()}-{id(sock)}"
            sock.bind("\0" + name)
            address = "@" + name
        else:
            sock.bind(str(path))
            address = str(path)
        sock.settimeout(NOTIFY_TIMEOUT_S)
        yield sock, address


def next_message(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


@pytest.mark.parametrize("abstract", [False, True])
def test_hub_tells_systemd_it_is_ready_once_it_serves(dataset: Path, tmp_path: Path, abstract: bool) -> None:
    with notify_socket(None if abstract else tmp_path / "notify") as (sock, address):
        proc = subprocess.Popen(
            hub_command("serve", "--root", dataset, "--listen", "127.0.0.1:0"),
            env={**hub_env(), "NOTIFY_SOCKET": address}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert next_message(sock) == "READY=1"
            assert proc.stdout is not None
            url = proc.stdout.readline().split(" on ", 1)[1].strip()
            with urllib.request.urlopen(url + "/healthz", timeout=10) as answer:  # serving when it said so
                assert answer.status == 200
            proc.send_signal(signal.SIGTERM)
            assert next_message(sock) == "STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.communicate(timeout=10)


def test_foreground_spoke_tells_systemd_it_is_ready_once_mounted(hub: HubProcess, tmp_path: Path) -> None:
    mountpoint, cache_dir = tmp_path / "mnt", tmp_path / "cache"
    mountpoint.mkdir()
    with notify_socket(tmp_path / "notify") as (sock, address):
        proc = subprocess.Popen(
            cachefs_command("mount", hub.url, mountpoint, "--cache-dir", cache_dir, "--foreground", *SPOKE_ARGS),
            env={**hub_env(), "NOTIFY_SOCKET": address}, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert next_message(sock) == "READY=1"
            assert is_mounted(mountpoint)
            assert sorted(p.name for p in mountpoint.iterdir())  # the files are there when it said so
            # Not `cachefs unmount`, which waits for the pid to go: this test is the parent that reaps it.
            subprocess.run(["fusermount3", "-u", str(mountpoint)], check=True, timeout=30)
            assert next_message(sock) == "STOPPING=1"
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                SpokeMount(mountpoint, cache_dir, daemon_pid(cache_dir)).unmount()
            proc.communicate(timeout=30)
