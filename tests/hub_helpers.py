"""Run a real hub (``python -m hubserver``) as a subprocess for tests.

Not a conftest: import it (``from hub_helpers import running_hub``) from any
test module in this directory.

    with running_hub(root) as hub:
        urllib.request.urlopen(hub.url + "/healthz")

The hub listens on 127.0.0.1 with a kernel-chosen port; ``hub.url`` is read
from the one line it prints on stdout once listening. Its stderr (the log)
is drained continuously, so a chatty hub never blocks on a full pipe, and is
available as ``hub.stderr_text()``. The hub is always stopped on leaving the
``with`` block, whether the test passed or not.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO_ROOT = Path(__file__).resolve().parent.parent
LISTENING_PREFIX = "cachefs-hub listening on "
# Bounds, not delays: a healthy hub starts in well under a second.
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


def hub_command(*args: str | os.PathLike[str]) -> list[str]:
    """The argv that runs the hub CLI with this interpreter."""
    return [sys.executable, "-m", "hubserver", *(os.fspath(arg) for arg in args)]


def hub_env() -> dict[str, str]:
    """The environment for a hub subprocess: this checkout importable first."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    return env


class _LineCollector:
    """Collects the lines of one pipe in a thread; lets tests wait on them."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self.new_lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for line in self._stream:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
            self.new_lines.put(line)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.new_lines.put(None)

    def text(self) -> str:
        with self._cond:
            return "".join(self._lines)

    def wait_for(self, needle: str, timeout_s: float) -> bool:
        """Wait until some line contains ``needle``; False on timeout or EOF."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if any(needle in line for line in self._lines):
                    return True
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    return False
                self._cond.wait(remaining)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


@dataclass
class HubProcess:
    """A running hub subprocess."""

    proc: subprocess.Popen[str]
    url: str  # e.g. "http://127.0.0.1:40123", no trailing slash
    host: str
    port: int
    _stdout: _LineCollector = field(repr=False)
    _stderr: _LineCollector = field(repr=False)

    def stderr_text(self) -> str:
        """Everything the hub logged so far (all of it once stopped)."""
        return self._stderr.text()

    def stdout_text(self) -> str:
        """Everything the hub printed on stdout so far."""
        return self._stdout.text()

    def wait_for_stderr(self, needle: str, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Wait (bounded) for a log line containing ``needle``."""
        return self._stderr.wait_for(needle, timeout_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit
        code (negative for a signal, as in subprocess). Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._stdout.join(timeout_s)
        self._stderr.join(timeout_s)
        return self.proc.returncode


def _parse_listening_line(line: str) -> tuple[str, str, int]:
    url = line[len(LISTENING_PREFIX) :].strip()
    hostport = url.removeprefix("http://")
    host, _, port = hostport.rpartition(":")
    return url, host.strip("[]"), int(port)


def start_hub(
    root: Path,
    extra_args: Sequence[str] = (),
    *,
    start_timeout_s: float = START_TIMEOUT_S,
) -> HubProcess:
    """Start a hub on 127.0.0.1:0 and wait until it listens.

    ``extra_args`` go after the defaults, so a later ``--listen`` or
    ``--log-level`` overrides them. The caller must ``stop()`` the result;
    prefer ``running_hub``. Raises RuntimeError (with the hub's stderr) if
    it exits or stays silent for ``start_timeout_s``.
    """
    args = ["serve", "--root", os.fspath(root), "--listen", "127.0.0.1:0", *extra_args]
    proc = subprocess.Popen(
        hub_command(*args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=hub_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    stdout = _LineCollector(proc.stdout)
    stderr = _LineCollector(proc.stderr)
    deadline = time.monotonic() + start_timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"hub did not listen within {start_timeout_s} s")
            try:
                line = stdout.new_lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"hub exited before listening (code {proc.wait(5)})")
            if line.startswith(LISTENING_PREFIX):
                url, host, port = _parse_listening_line(line)
                return HubProcess(proc, url, host, port, stdout, stderr)
    except BaseException as exc:
        hub = HubProcess(proc, "", "", 0, stdout, stderr)
        hub.stop()
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}; stderr:\n{hub.stderr_text()}") from None
        raise


@contextmanager
def running_hub(
    root: Path,
    extra_args: Sequence[str] = (),
    *,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[HubProcess]:
    """A hub serving ``root`` for the duration of the ``with`` block."""
    hub = start_hub(root, extra_args, start_timeout_s=start_timeout_s)
    try:
        yield hub
    finally:
        hub.stop()


def run_hub_cli(
    args: Sequence[str | os.PathLike[str]], timeout_s: float = START_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run the hub CLI to completion (for error cases and --help)."""
    return subprocess.run(
        hub_command(*args),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=hub_env(),
        timeout=timeout_s,
        check=False,
    )
