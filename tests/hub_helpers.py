"""Run a real hub (``python -m hubserver``) as a subprocess for tests.

Not a conftest: import it (``from hub_helpers import running_hub``) from any
test module in this directory.

    with running_hub(root) as hub:
        urllib.request.urlopen(hub.url + "/healthz")

The hub listens on 127.0.0.1 with a kernel-chosen port; ``hub.url`` is read
from the one line it prints on stdout once listening (``https://`` with
TLS). Its stderr (the log)
is drained continuously, so a chatty hub never blocks on a full pipe, and is
available as ``hub.stderr_text()``. The hub is always stopped on leaving the
``with`` block, whether the test passed or not.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import queue
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import trio

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
    url: str  # e.g. "http://127.0.0.1:40123" ("https://" with TLS), no trailing slash
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
    hostport = url.partition("://")[2]
    host, _, port = hostport.rpartition(":")
    return url, host.strip("[]"), int(port)


def start_hub(
    root: Path,
    extra_args: Sequence[str] = (),
    *,
    start_timeout_s: float = START_TIMEOUT_S,
    wrapper: Sequence[str] = (),
) -> HubProcess:
    """Start a hub on 127.0.0.1:0 and wait until it listens.

    ``extra_args`` go after the defaults, so a later ``--listen`` or
    ``--log-level`` overrides them. ``wrapper`` is a command that execs the
    hub's (``unshare --net``: in a network namespace of its own). The caller
    must ``stop()`` the result; prefer ``running_hub``. Raises RuntimeError
    (with the hub's stderr) if it exits or stays silent for ``start_timeout_s``.
    """
    args = ["serve", "--root", os.fspath(root), "--listen", "127.0.0.1:0", *extra_args]
    proc = subprocess.Popen(
        [*wrapper, *hub_command(*args)],
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
    wrapper: Sequence[str] = (),
) -> Iterator[HubProcess]:
    """A hub serving ``root`` for the duration of the ``with`` block."""
    hub = start_hub(root, extra_args, start_timeout_s=start_timeout_s, wrapper=wrapper)
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


# --------------------------------------------------------------- client side


@dataclass
class Reply:
    """A complete HTTP response; header names lower-cased."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_get(
    hub: HubProcess | str,
    path: str,
    headers: Mapping[str, str] | None = None,
    *,
    ssl_context: ssl.SSLContext | None = None,
    method: str = "GET",
    timeout_s: float = 10.0,
) -> Reply:
    """One request on a fresh connection to a hub (or a server at a base URL such as
    "http://127.0.0.1:8080"), the path sent exactly as given. HTTPS when ``ssl_context`` is given."""
    if isinstance(hub, str):
        address = urllib.parse.urlsplit(hub)
        host, port = address.hostname or "127.0.0.1", address.port or 80
    else:
        host, port = hub.host, hub.port
    conn: http.client.HTTPConnection
    if ssl_context is not None:
        conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ssl_context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request(method, path, headers=dict(headers or {}))
        response = conn.getresponse()
        body = response.read()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, body)
    finally:
        conn.close()


@dataclass
class Manifest:
    """A hub's manifest as served: its header, entries (and their lines as sent), and the reply."""

    header: dict[str, Any]
    entries: list[dict[str, Any]]
    entry_lines: list[bytes]
    reply: Reply

    def by_path(self) -> dict[str, dict[str, Any]]:
        return {str(entry["p"]): entry for entry in self.entries}

    def file(self, path: str) -> dict[str, Any]:
        return self.by_path()[path]

    def files(self) -> dict[str, dict[str, Any]]:
        """The regular files' entries, by path."""
        return {path: entry for path, entry in self.by_path().items() if entry["k"] == "f"}


def fetch_manifest(
    hub: HubProcess | str, headers: Mapping[str, str] | None = None, *, ssl_context: ssl.SSLContext | None = None
) -> Manifest:
    """GET /v1/manifest from a hub (or a server in front of one, at a base URL); it must answer 200."""
    reply = http_get(hub, "/v1/manifest", headers, ssl_context=ssl_context, timeout_s=30.0)
    assert reply.status == 200, (reply.status, reply.body[:200])
    lines = gzip.decompress(reply.body).splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines)
    return Manifest(json.loads(lines[0]), [json.loads(line) for line in lines[1:]], lines[1:], reply)


def hub_health(hub: HubProcess | str) -> dict[str, Any]:
    """GET /healthz."""
    reply = http_get(hub, "/healthz")
    assert reply.status == 200, (reply.status, reply.body[:200])
    return reply.json()


def wait_for_generation_change(hub: HubProcess | str, before: str, timeout_s: float = 30.0) -> None:
    """Until the hub serves a generation other than `before` (it rescanned)."""
    assert wait_until(lambda: hub_health(hub)["generation"] != before, timeout_s, interval_s=0.1), "the hub did not rescan"


def free_port() -> int:
    """A loopback port nobody listens on (the kernel's choice, released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def raw_exchange(host: str, port: int, data: bytes, timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection and read until the server closes
    it. Returns what was read and whether the server closed within
    ``timeout_s`` (False: still open at the deadline)."""
    deadline = time.monotonic() + timeout_s
    received = bytearray()
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server may close on a partial request; read what it said
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(received), False
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return bytes(received), False
            except OSError:
                return bytes(received), True  # reset: closed
            if not chunk:
                return bytes(received), True
            received += chunk


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_metrics(
    hub: HubProcess,
    headers: Mapping[str, str] | None = None,
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> Samples:
    """GET /metrics and parse it: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = http_get(hub, "/metrics", headers, ssl_context=ssl_context)
    assert reply.status == 200, reply.body[:200]
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The value of one sample, 0 if absent."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def read_request_head(stream: trio.SocketStream) -> bytes | None:
    """The bytes of one request up to the end of its head, as a small test server on trio
    reads them; None if the client closed first."""
    request = b""
    while b"\r\n\r\n" not in request:
        data = await stream.receive_some(4096)
        if not data:
            return None
        request += data
    return request
