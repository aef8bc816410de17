"""One install per role, as deploy/Containerfile runs it (scripts/install.sh, the same
script as `make install`), into a temporary prefix: the hub without FUSE or a compiler
serves the dataset; the spoke with a stock pyfuse3 built against the system's libfuse3
mounts it; both from the installed commands, with this checkout off the Python path."""

from __future__ import annotations

import re
import shlex
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from dataset import source_files
from hub_helpers import LISTENING_PREFIX, HubProcess
from install_helpers import INSTALL_TIMEOUT_S, REPO_ROOT, offline_env
from mount_helpers import SpokeMount, daemon_pid, is_mounted

CONTAINERFILE = REPO_ROOT / "deploy" / "Containerfile"


def containerfile_install(target: str) -> list[str]:
    """The scripts/install.sh command of a Containerfile stage, as an argv."""
    stages = re.split(r"^FROM ", CONTAINERFILE.read_text(), flags=re.MULTILINE)
    (stage,) = [s for s in stages if re.match(rf"\S+ AS {re.escape(target)}\n", s)]
    runs = re.findall(r"^RUN ((?:.*\\\n)*.*)$", stage, re.MULTILINE)
    commands = [part.strip() for run in runs for part in run.replace("\\\n", " ").split("&&")]
    (install,) = [c for c in commands if "scripts/install.sh" in c]
    return shlex.split(install)


def install_as_in_the_image(target: str, tmp_path: Path) -> tuple[Path, Path]:
    """Run the stage's install command with /src as this checkout and the image's
    /opt/cachefs and /usr/local/bin under tmp_path; returns (prefix, bin dir)."""
    argv = containerfile_install(target)
    assert argv[0] == "/src/scripts/install.sh"
    prefix, bin_dir = tmp_path / "opt" / "cachefs", tmp_path / "bin"
    replaced = {"/opt/cachefs": str(prefix), "/usr/local/bin": str(bin_dir)}
    argv = [str(REPO_ROOT / "scripts" / "install.sh"), *(replaced.get(arg, arg) for arg in argv[1:])]
    assert "--no-system-files" in argv and str(prefix) in argv and str(bin_dir) in argv
    result = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=offline_env(),
                            stdin=subprocess.DEVNULL, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return prefix, bin_dir


def installed_module(prefix: Path, module: str) -> str | None:
    """Where the prefix's Python finds `module` (None: not installed)."""
    code = f"import importlib.util as u; s = u.find_spec({module!r}); print(s.origin if s else '')"
    result = subprocess.run([prefix / "bin" / "python", "-c", code], capture_output=True, text=True, timeout=60,
                            env=offline_env(), cwd=prefix, check=True)  # not this checkout's directory
    return result.stdout.strip() or None


@pytest.fixture
def installed_hub(dataset: Path, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """The hub image's install, serving `dataset` from its own command: (prefix, url)."""
    prefix, bin_dir = install_as_in_the_image("hub", tmp_path)
    assert sorted(p.name for p in bin_dir.iterdir()) == ["cachefs-hub"]
    proc = subprocess.Popen([bin_dir / "cachefs-hub", "serve", "--root", dataset, "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=offline_env(),
                            stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(LISTENING_PREFIX), line + proc.communicate(timeout=10)[1]
        yield prefix, line.removeprefix(LISTENING_PREFIX).strip()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_the_hub_installs_and_serves_without_fuse(installed_hub: tuple[Path, str], dataset: Path) -> None:
    prefix, url = installed_hub
    assert installed_module(prefix, "pyfuse3") is None  # no FUSE build for a hub
    assert installed_module(prefix, "hubserver").startswith(str(prefix))  # the installed hub, not this checkout
    version = subprocess.run([prefix / "bin" / "cachefs-hub", "--version"], capture_output=True, text=True,
                             timeout=60, env=offline_env(), check=True)
    assert version.stdout.startswith("cachefs-hub ")
    with urllib.request.urlopen(url + "/healthz", timeout=30) as answer:
        assert answer.status == 200
    # The spoke's command is there too, and says what it lacks.
    (prefix / "mnt").mkdir()
    mount = subprocess.run([prefix / "bin" / "cachefs", "mount", url, prefix / "mnt", "--cache-dir", prefix / "cache"],
                           capture_output=True, text=True, timeout=60, env=offline_env(), check=False)
    assert mount.returncode == 1
    assert mount.stderr == "cachefs: error: pyfuse3 is not installed: install the spoke with `pip install 'cachefs[spoke]'`\n"


def test_the_spoke_installs_with_stock_pyfuse3_and_mounts(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    prefix, bin_dir = install_as_in_the_image("spoke-build", tmp_path)
    assert sorted(p.name for p in bin_dir.iterdir()) == ["cachefs"]
    pyfuse3 = installed_module(prefix, "pyfuse3")
    assert pyfuse3 is not None and pyfuse3.startswith(str(prefix))
    assert installed_module(prefix, "aiohttp") is None  # the hub's dependency stays out of a spoke
    serve = subprocess.run([prefix / "bin" / "cachefs-hub", "serve", "--root", dataset], capture_output=True, text=True,
                           timeout=60, env=offline_env(), check=False)
    assert serve.returncode == 1
    assert serve.stderr == "cachefs-hub: error: aiohttp is not installed: install the hub with `pip install 'cachefs[hub]'`\n"
    mountpoint, cache_dir = tmp_path / "mnt", tmp_path / "cache"
    mountpoint.mkdir()
    cachefs = str(bin_dir / "cachefs")
    try:
        mounted = subprocess.run([cachefs, "mount", hub.url, mountpoint, "--cache-dir", cache_dir],
                                 capture_output=True, text=True, timeout=120, env=offline_env(), check=False)
        assert mounted.returncode == 0, mounted.stderr
        for relative in source_files(dataset)[:10]:
            assert (mountpoint / relative).read_bytes() == (dataset / relative).read_bytes(), relative
        # Passthrough is on by default: with the stock pyfuse3 the daemon serves every read, said once, no warning.
        log = (cache_dir / "cachefs.log").read_text()
        assert log.count("FUSE passthrough is not available (this pyfuse3 cannot hand files to the kernel") == 1, log
        assert " WARNING " not in log and " ERROR " not in log, log
        unmounted = subprocess.run([cachefs, "unmount", mountpoint], capture_output=True, text=True, timeout=120,
                                   env=offline_env(), check=False)
        assert unmounted.returncode == 0, unmounted.stderr
        assert not is_mounted(mountpoint)
    finally:
        SpokeMount(mountpoint, cache_dir, daemon_pid(cache_dir)).unmount()


def test_install_refuses_bad_arguments_in_one_line(tmp_path: Path) -> None:
    for args, message in [
        (["--role", "cache"], "--role is hub, spoke or all, not 'cache'"),
        (["--prefix", "relative/dir"], "--prefix must be an absolute path"),
        (["--role", "hub", "--passthrough"], "--passthrough is for a spoke"),
        (["--no-passthrough-build", "--bogus"], "unknown argument '--bogus'"),
        (["--colour"], "unknown argument '--colour'"),
    ]:
        result = subprocess.run([REPO_ROOT / "scripts" / "install.sh", *args], capture_output=True, text=True,
                                timeout=60, env=offline_env(), cwd=tmp_path, check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
