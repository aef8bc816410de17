"""nginx from the tests: the shipped regional cache config (deploy/nginx/regional-cache.conf)
rendered with test addresses and paths, run as a foreground subprocess on a loopback port.

nginx is Debian's package (the Makefile's APT_PACKAGES installs it). No nginx
is a failure, not a skip: the shipped config would go untested.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hub_helpers import HubProcess, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_CONFIG = REPO_ROOT / "deploy" / "nginx" / "regional-cache.conf"
SLICE_BYTES = 1024 * 1024  # `slice 1m;` in the shipped config
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0


def find_nginx() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("nginx is not installed: `make test` installs it (Makefile APT_PACKAGES), or apt-get install nginx")
    return found


def substitute_once(text: str, old: str, new: str) -> str:
    """Replace a line fragment the shipped config must contain exactly once,
    so that a change to the shipped file breaks this test loudly."""
    assert text.count(old) == 1, f"{SHIPPED_CONFIG.name} should contain {old!r} exactly once"
    return text.replace(old, new)


def render_config(hub: HubProcess, prefix: Path, port: int, edits: Sequence[tuple[str, str]] = (),
                  site: str | None = None) -> Path:
    """The shipped config with test addresses and paths (and `edits`: (old, new) fragments),
    inside a minimal main config. `site`: a config already made from the shipped one for
    this hub (the Kubernetes tier's), given its cache path, port and log here."""
    if site is None:
        site = SHIPPED_CONFIG.read_text()
        site = substitute_once(site, "server hub.example.internal:8470;", f"server {hub.host}:{hub.port};")
        site = substitute_once(site, "access_log /var/log/nginx/cachefs-regional.access.log ", "access_log /dev/stdout ")
    site = substitute_once(site, "proxy_cache_path /var/cache/nginx/cachefs ", f"proxy_cache_path {prefix / 'cache'} ")
    for old, new in edits:
        site = substitute_once(site, old, new)
    site = substitute_once(site, "listen 8470;", f"listen 127.0.0.1:{port};")
    site = substitute_once(site, "access_log /dev/stdout ", f"access_log {prefix / 'access.log'} ")
    (prefix / "regional-cache.conf").write_text(site)
    for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / "temp" / temp).mkdir(parents=True, exist_ok=True)
    # As root, nginx's workers would switch to "nobody", which cannot enter
    # pytest's 0700 temp dirs; not root, the directive would only warn.
    user = "user root root;\n" if os.geteuid() == 0 else ""
    main = prefix / "nginx.conf"
    main.write_text(
        f"{user}worker_processes 1;\n"
        f"pid {prefix / 'nginx.pid'};\n"
        f"error_log {prefix / 'error.log'} info;\n"
        "events { worker_connections 512; }\n"
        "http {\n"
        + "".join(f"    {kind}_temp_path {prefix / 'temp' / temp};\n" for kind, temp in [
            ("client_body", "body"), ("proxy", "proxy"), ("fastcgi", "fastcgi"), ("uwsgi", "uwsgi"), ("scgi", "scgi")])
        + f"    include {prefix / 'regional-cache.conf'};\n"
        "}\n"
    )
    return main


@dataclass
class RegionalCache:
    url: str
    prefix: Path
    port: int
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL to nginx's master and workers at once: connections are reset, nothing is finished."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(STOP_TIMEOUT_S)

    def access_log(self) -> str:
        try:
            return (self.prefix / "access.log").read_text(errors="replace")
        except OSError:
            return ""

    def error_log(self) -> str:
        try:
            return (self.prefix / "error.log").read_text(errors="replace")
        except OSError:
            return ""


@contextmanager
def running_nginx(hub: HubProcess, prefix: Path, edits: Sequence[tuple[str, str]] = (),
                  site: str | None = None) -> Iterator[RegionalCache]:
    """nginx with the rendered config (render_config), in the foreground, stopped (and its
    process group killed if need be) on leaving the block."""
    nginx = find_nginx()
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = render_config(hub, prefix, port, edits, site)
    base = [nginx, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30, check=False)
    assert check.returncode == 0, f"nginx -t rejected the rendered config:\n{check.stderr}"
    proc = subprocess.Popen(
        [*base, "-g", "daemon off;"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: workers are killed with it
    )
    cache = RegionalCache(f"http://127.0.0.1:{port}", prefix, port, proc)
    try:
        _wait_until_serving(cache, proc)
        yield cache
    finally:
        _stop(proc)


def _wait_until_serving(cache: RegionalCache, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"nginx exited with {proc.returncode}:\n{cache.error_log()}")
        try:
            with urllib.request.urlopen(cache.url + "/regional-cache/healthz", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"nginx did not answer within {START_TIMEOUT_S} s:\n{cache.error_log()}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGQUIT (graceful), then SIGKILL to the whole process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # workers left behind, if any
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(STOP_TIMEOUT_S)


