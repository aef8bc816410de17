"""`systemctl` for the operator walkthrough, where systemd is not PID 1: starts an
installed unit the way systemd would and as far as a test can, then returns.

    python3 unit_runner.py STATE_DIR enable --now cachefs-hub
    python3 unit_runner.py STATE_DIR start cachefs@mnt-data
    python3 unit_runner.py STATE_DIR stop cachefs@mnt-data
    python3 unit_runner.py STATE_DIR daemon-reload

What it applies from /etc/systemd/system/UNIT.service: the specifiers %i %I %f %n
%%, EnvironmentFile= (a leading "-": may be missing), ExecStartPre= (a leading "-":
may fail), ExecStart= with systemd's expansion (${VAR} one word, $VAR split at
whitespace), User=/Group= (with the user's supplementary groups), UMask=,
NoNewPrivileges= and CapabilityBoundingSet= (through setpriv), Type=notify (it
returns once READY=1 came to a real $NOTIFY_SOCKET, fails if the service exits
first); ExecStop= or SIGTERM to stop. The sandboxing options are not applied
here (tests/test_deploy.py checks them with systemd-analyze). The service's
output goes to STATE_DIR/UNIT.log, its pid to STATE_DIR/UNIT.pid.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

UNIT_DIR = Path("/etc/systemd/system")
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def fail(message: str) -> None:
    print(f"systemctl: {message}", file=sys.stderr)
    raise SystemExit(1)


def unit_file(name: str) -> tuple[Path, str]:
    """The unit's file (a template for NAME@INSTANCE) and the instance."""
    base, _, instance = name.removesuffix(".service").partition("@")
    path = UNIT_DIR / (f"{base}@.service" if instance else f"{base}.service")
    if not path.exists():
        fail(f"unit {name} is not installed ({path})")
    return path, instance


def parse(path: Path, specifiers: dict[str, str]) -> dict[str, list[str]]:
    """The [Service] and [Unit] keys, specifiers expanded (repeated keys kept in order)."""
    keys: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        value = re.sub(r"%(.)", lambda m: specifiers.get(m.group(1), m.group(0)), value.strip())
        keys.setdefault(key.strip(), []).append(value)
    return keys


def environment(keys: dict[str, list[str]]) -> dict[str, str]:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    for entry in keys.get("EnvironmentFile", []):
        optional, path = entry.startswith("-"), Path(entry.lstrip("-"))
        if not path.exists():
            if optional:
                continue
            fail(f"environment file {path} is missing")
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", ";")) and "=" in line:
                name, _, value = line.partition("=")
                env[name.strip()] = value.strip().strip('"')
    return env


def command_line(value: str, env: dict[str, str]) -> tuple[list[str], bool]:
    """An Exec*= line as argv, and whether a failure is ignored ("-" prefix)."""
    ignore = value.startswith("-")
    words = []
    for word in shlex.split(value.lstrip("-@:+!")):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            words += env.get(whole.group(1), "").split()
        else:
            words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return words, ignore


def privileges(keys: dict[str, list[str]]) -> list[str]:
    """setpriv arguments for User=, Group=, NoNewPrivileges=, CapabilityBoundingSet=."""
    prefix = ["setpriv"]
    if "User" in keys:
        prefix += [f"--reuid={keys['User'][-1]}", f"--regid={keys.get('Group', keys['User'])[-1]}", "--init-groups"]
    if "CapabilityBoundingSet" in keys:
        caps = keys["CapabilityBoundingSet"][-1].split()
        prefix += ["--bounding-set=" + ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in caps)])]
    if keys.get("NoNewPrivileges") == ["yes"]:
        prefix.append("--no-new-privs")
    return prefix if len(prefix) > 1 else []


def start(name: str, state: Path) -> None:
    path, instance = unit_file(name)
    specifiers = {"i": instance, "I": instance, "f": "/" + instance.replace("-", "/") if instance else "/",
                  "n": name, "%": "%"}
    keys = parse(path, specifiers)
    env = environment(keys)
    for value in keys.get("ExecStartPre", []):
        argv, ignore = command_line(value, env)
        if subprocess.run(argv, check=False).returncode != 0 and not ignore:
            fail(f"{name}: ExecStartPre {shlex.join(argv)} failed")
    (argv, _) = command_line(keys["ExecStart"][-1], env)
    log = open(state / f"{name}.log", "ab")  # noqa: SIM115 (the service keeps it)
    notify = keys.get("Type", ["simple"])[-1] == "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if notify:
        # Abstract, as no file permission stands between it and the service's user.
        address = f"cachefs-unit-runner-{os.getpid()}-{name}"
        sock.bind("\0" + address)
        env["NOTIFY_SOCKET"] = "@" + address
    umask = int(keys.get("UMask", ["0022"])[-1], 8)
    process = subprocess.Popen([*privileges(keys), *argv], env=env, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=log, start_new_session=True, preexec_fn=lambda: os.umask(umask))
    (state / f"{name}.pid").write_text(f"{process.pid}\n")
    if not notify:
        return
    sock.settimeout(0.5)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if b"READY=1" in sock.recv(4096).split(b"\n"):
                return
        except TimeoutError:
            pass
        if process.poll() is not None:
            fail(f"{name} exited with {process.returncode} before READY=1:\n{(state / f'{name}.log').read_text()}")
    fail(f"{name} sent no READY=1 within {READY_TIMEOUT_S:g} s")


def stop(name: str, state: Path) -> None:
    path, instance = unit_file(name)
    specifiers = {"i": instance, "I": instance, "f": "/" + instance.replace("-", "/") if instance else "/",
                  "n": name, "%": "%"}
    keys = parse(path, specifiers)
    pid = int((state / f"{name}.pid").read_text())
    for value in keys.get("ExecStop", []):
        argv, ignore = command_line(value, {**environment(keys), "MAINPID": str(pid)})
        if subprocess.run(argv, check=False).returncode != 0 and not ignore:
            fail(f"{name}: ExecStop {shlex.join(argv)} failed")
    deadline = time.monotonic() + STOP_TIMEOUT_S
    if not keys.get("ExecStop"):
        os.kill(pid, signal.SIGTERM)
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    fail(f"{name} (pid {pid}) did not stop within {STOP_TIMEOUT_S:g} s")


def main(argv: list[str]) -> None:
    state, verb, *rest = argv
    names = [arg for arg in rest if not arg.startswith("--")]
    if verb == "daemon-reload":
        return
    if verb in ("start", "enable", "restart") and (verb != "enable" or "--now" in rest):
        for name in names:
            start(name, Path(state))
    elif verb == "stop":
        for name in names:
            stop(name, Path(state))
    elif verb != "enable":
        fail(f"{verb} is not supported here")


if __name__ == "__main__":
    main(sys.argv[1:])
