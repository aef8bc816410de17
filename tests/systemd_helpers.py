"""systemd units from the tests: their keys, and the privileges they grant applied with setpriv."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest


def require_tool(name: str) -> str:
    """A tool the deploy tests need; missing is a failure (the Makefile installs it)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        pytest.fail(f"{name} is not installed: `make test` installs it (Makefile APT_PACKAGES)")
    return found


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values, in order (systemd allows repeated keys, which
    configparser does not). Comments and blank lines are skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


# Turns on MemoryDenyWriteExecute's kernel mechanism (PR_SET_MDWE, Linux
# >= 6.3; inherited across fork and exec), then execs the command.
MDWE_EXEC = textwrap.dedent(
    """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(65, 1, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: kernel too old
        sys.exit("PR_SET_MDWE: " + os.strerror(ctypes.get_errno()))
    os.execvp(sys.argv[1], sys.argv[1:])
    """
)


def unit_privileges(unit: Path) -> list[str]:
    """A command prefix that applies the unit's NoNewPrivileges=,
    CapabilityBoundingSet= and MemoryDenyWriteExecute= to what follows."""
    service = parse_unit(unit)["Service"]
    capabilities = service["CapabilityBoundingSet"][-1].split()
    bounding = ",".join(["-all", *(f"+{cap.removeprefix('CAP_').lower()}" for cap in capabilities)])
    prefix = [require_tool("setpriv"), f"--bounding-set={bounding}", "--inh-caps=-all"]
    if service.get("NoNewPrivileges") == ["yes"]:
        prefix.append("--no-new-privs")
    if service.get("MemoryDenyWriteExecute") == ["yes"]:
        prefix += [sys.executable, "-c", MDWE_EXEC]
    return prefix
