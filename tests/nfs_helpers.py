"""Run NFS-Ganesha (through `cachefs export --run`) in a network namespace of its own, for tests.

NFSv3 needs rpcbind on port 111: each test gets its own network namespace
(loopback only) whose rpcbind holds it open, so nothing outside the test sees
either server. Ganesha runs in a fresh mount namespace per start (so it sees
the spoke's current mount) with the rpcbind's /run bound over its own, and is
always stopped, with rpcbind, on leaving the block.

    with nfs_namespace(tmp_path) as ns:
        server = ns.start_ganesha(spoke.mountpoint)
        ns.run(["nfs-ls", ns.url("/")])
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from hub_helpers import hub_env

from cachefs.processes import wait_for_pid

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
READY_LINE = "NFS SERVER INITIALIZED"
NFS_CLIENT = Path(__file__).with_name("nfs_client.py")
# A new mount namespace copies every mount, and a FUSE mount copied there stays alive
# (its daemon waiting) after the original is unmounted: drop the copies of FUSE
# mounts, all but the one given (shell; /proc/self/mounts escapes spaces as \040).
DETACH_FUSE_MOUNTS = (
    "detach() { awk '$3 ~ /^fuse/ {print $2}' /proc/self/mounts | while read -r m; do"
    ' m=$(printf %b "$m"); [ "$m" = "$1" ] || umount -l "$m"; done; }; detach'
)


class NfsNamespace:
    """A loopback-only network namespace held by its rpcbind; Ganesha servers started in it."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._ganesha: list[subprocess.Popen[bytes]] = []
        script = (
            f"{DETACH_FUSE_MOUNTS} && ip link set lo up && mount -t tmpfs -o mode=0755 tmpfs /run"
            " && mkdir /run/rpcbind && exec rpcbind -f"
        )
        # unshare and sh exec into rpcbind: this pid is the namespace's holder.
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", script],
            start_new_session=True, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not Path(f"/proc/{self._holder.pid}/root/run/rpcbind.sock").exists():
            assert self._holder.poll() is None, "rpcbind did not start"
            assert time.monotonic() < deadline, "rpcbind did not come up"
            time.sleep(0.05)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", *argv]

    def run(self, argv: Sequence[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(self.command(argv), capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)

    def start_ganesha(self, mountpoint: Path, *export_args: str, wrapper: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """`cachefs export MOUNTPOINT --run` in the namespace, once it serves; `wrapper`: a
        command that execs it (with a unit's privileges)."""
        state_dir = self._workdir / f"ganesha-{len(self._ganesha)}"
        log_path = state_dir.with_suffix(".log")
        export = [
            *wrapper, sys.executable, "-m", "cachefs", "export", str(mountpoint), "--clients", "127.0.0.1",
            "--grace-period", "0", "--state-dir", str(state_dir), "--run", *export_args,
        ]
        keep = shlex.quote(os.path.abspath(mountpoint))
        inner = f"{DETACH_FUSE_MOUNTS} {keep} && mount --bind /proc/{self._holder.pid}/root/run /run && exec \"$@\""
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                self.command(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, "sh", *export]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=hub_env(), start_new_session=True,
            )
        self._ganesha.append(process)
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY_LINE not in log_path.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop_ganesha(process)
                raise AssertionError(f"ganesha did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        return process

    def stop_ganesha(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM (Ganesha's clean shutdown), SIGKILL if it hangs; pid is Ganesha itself (exec chain)."""
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(STOP_TIMEOUT_S)

    def close(self) -> None:
        for process in self._ganesha:
            self.stop_ganesha(process)
        if self._holder.poll() is None:
            self._holder.terminate()
            try:
                self._holder.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._holder.kill()
                self._holder.wait(STOP_TIMEOUT_S)
        wait_for_pid(self._holder.pid, STOP_TIMEOUT_S)


@contextmanager
def nfs_namespace(workdir: Path) -> Iterator[NfsNamespace]:
    namespace = NfsNamespace(workdir)
    try:
        yield namespace
    finally:
        namespace.close()


class IdleNfsClient:
    """tests/nfs_client.py in the namespace: one mount, file handles held between commands."""

    def __init__(self, namespace: NfsNamespace, export: str, version: int) -> None:
        self._process = subprocess.Popen(
            namespace.command([sys.executable, str(NFS_CLIENT), "127.0.0.1", export, str(version)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        hello = self._answer()
        assert hello["ok"], hello

    def _answer(self) -> dict[str, Any]:
        stdout: IO[str] = self._process.stdout  # type: ignore[assignment]
        line = stdout.readline()
        assert line, "the NFS client died"
        return json.loads(line)

    def ask(self, **command: Any) -> dict[str, Any]:
        stdin: IO[str] = self._process.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()
        return self._answer()

    def open(self, path: str) -> int:
        answer = self.ask(op="open", path=path)
        assert answer["ok"], answer
        return int(answer["id"])

    def read(self, file: int, offset: int, size: int) -> bytes | int:
        """The bytes, or the errno the read failed with."""
        answer = self.ask(op="read", id=file, offset=offset, size=size)
        return bytes.fromhex(answer["data"]) if answer["ok"] else int(answer["errno"])

    def size(self, file: int) -> int:
        """The file's size (a GETATTR of the handle), or minus the errno it failed with."""
        answer = self.ask(op="fstat", id=file)
        return int(answer["size"]) if answer["ok"] else -int(answer["errno"])

    def close(self) -> None:
        if self._process.stdin:
            self._process.stdin.close()
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(STOP_TIMEOUT_S)


@contextmanager
def idle_nfs_client(namespace: NfsNamespace, export: str, version: int = 3) -> Iterator[IdleNfsClient]:
    client = IdleNfsClient(namespace, export, version)
    try:
        yield client
    finally:
        client.close()
