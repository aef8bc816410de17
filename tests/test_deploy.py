"""The deployment files under deploy/, checked with the real tools:
systemd-analyze, systemd-sysusers and systemd-tmpfiles on the units, setpriv for the privileges
the units grant, a real hub and FUSE mount for the mount.cachefs helper,
promtool on the Prometheus config and every alert, kubernetes-validate on
the manifests. The nginx tier has its own file, test_regional_cache.py.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from dataset import source_files
from hub_helpers import HubProcess, fetch_manifest, free_port, hub_env, running_hub
from mount_helpers import SpokeMount, daemon_pid, is_mounted, mounted_spoke, run_cachefs
from systemd_helpers import parse_unit, require_tool, unit_privileges

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOY = REPO_ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
HUB_UNIT = SYSTEMD / "cachefs-hub.service"
SPOKE_UNIT = SYSTEMD / "cachefs@.service"
# The install prefix the shipped units name; scripts/install.sh writes its own.
UNIT_PREFIX = "/opt/cachefs"
MOUNT_HELPER = DEPLOY / "mount.cachefs"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "cachefs-dashboard.json"
KUBERNETES = DEPLOY / "kubernetes"
CONTAINERFILE = DEPLOY / "Containerfile"
TOOL_TIMEOUT_S = 60

# The spoke metrics the alerts and the dashboard are built on: a live spoke
# (cachefs mount --metrics-listen) must export them. Every name the files use
# is checked against what a live hub and a live spoke export.
SPOKE_METRICS = {
    "cachefs_block_hits_total",
    "cachefs_block_misses_total",
    "cachefs_fetched_bytes_total",
    "cachefs_fetch_duration_seconds",
    "cachefs_cache_used_bytes",
    "cachefs_cache_capacity_bytes",
    "cachefs_cache_pinned_bytes",
    "cachefs_corrupt_blocks_total",
    "cachefs_upstream_errors_total",
    "cachefs_read_duration_seconds",
    "cachefs_reads_total",
    "cachefs_read_bytes_total",
    "cachefs_fuse_errors_total",
    "cachefs_fetch_failures_total",
    "cachefs_store_errors_total",
    "cachefs_read_stall_seconds",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_max_fds",
}
# Options that give a service its own mount namespace, which would hide the
# spoke's FUSE mount from the rest of the host.
MOUNT_NAMESPACE_OPTIONS = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts", "ReadOnlyPaths",
    "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths",
    "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
    "ProtectProc", "ProcSubset", "RootDirectory", "RootImage", "MountAPIVFS", "DynamicUser", "PrivateUsers",
}


def run_tool(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [os.fspath(arg) for arg in args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
        check=False, stdin=subprocess.DEVNULL, env=env,
    )


# -- systemd ----------------------------------------------------------------------


def cachefs_executable(name: str) -> Path:
    """The installed console script (cachefs, cachefs-hub) of this environment."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return beside
    found = shutil.which(name)
    assert found, f"{name} is not installed in this environment (pip install -e .)"
    return Path(found)


def installed_copy(unit: Path, directory: Path) -> Path:
    """The unit with the install prefix's commands replaced by this environment's
    scripts, since systemd-analyze verify checks that ExecStart= commands exist."""
    text = unit.read_text()
    for name in ("cachefs-hub", "cachefs"):
        text = re.sub(rf"{UNIT_PREFIX}/bin/{name}\b(?!-)", str(cachefs_executable(name)), text)
    assert f"{UNIT_PREFIX}/" not in text and "/usr/local/" not in text
    copy = directory / unit.name
    copy.write_text(text)
    return copy


@pytest.mark.parametrize("unit, name", [(HUB_UNIT, "cachefs-hub.service"), (SPOKE_UNIT, "cachefs@mnt-data.service")])
def test_systemd_analyze_verify_is_clean(unit: Path, name: str, tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    installed_copy(unit, tmp_path)
    # The template is verified through an instance, so %i and %f are expanded.
    result = run_tool(analyze, "verify", "--man=no", tmp_path / name)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", f"systemd-analyze verify warns:\n{result.stderr}"


@pytest.mark.parametrize(
    "unit, name, max_exposure",
    [
        (HUB_UNIT, "cachefs-hub.service", 2.0),  # "OK": unprivileged, read-only, no capabilities
        (SPOKE_UNIT, "cachefs@mnt-data.service", 5.0),  # root and CAP_SYS_ADMIN: it mounts
        (SYSTEMD / "cachefs-nfs@.service", "cachefs-nfs@mnt-data.service", 2.5),  # CAP_DAC_READ_SEARCH, sandboxed
    ],
)
def test_systemd_security_exposure(unit: Path, name: str, max_exposure: float, tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    installed_copy(unit, tmp_path)
    result = run_tool(
        analyze, "security", "--offline=true", f"--threshold={int(max_exposure * 10)}", "--no-pager", tmp_path / name
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr


def test_hub_unit_settings() -> None:
    service = parse_unit(HUB_UNIT)["Service"]
    assert service["Type"] == ["notify"]  # the hub sends READY=1 once it serves (tests/test_sd_notify.py)
    assert service["EnvironmentFile"] == ["/etc/cachefs/hub.env"]
    exec_start = service["ExecStart"][0]
    assert " serve --root ${CACHEFS_HUB_ROOT} --listen ${CACHEFS_HUB_LISTEN} $CACHEFS_HUB_ARGS" in exec_start
    assert service["User"] == ["cachefs"] and "DynamicUser" not in service
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # token files reload on SIGHUP
    assert service["Restart"] == ["on-failure"]
    for key, value in {
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "PrivateDevices": "yes", "CapabilityBoundingSet": "", "MemoryDenyWriteExecute": "yes",
    }.items():
        assert service[key] == [value], key
    assert "@system-service" in service["SystemCallFilter"]
    assert set(service["RestrictAddressFamilies"][0].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert service["ReadOnlyPaths"], "the dataset location should be named read-only"


def test_spoke_unit_settings() -> None:
    unit = parse_unit(SPOKE_UNIT)
    service = unit["Service"]
    assert "network-online.target" in unit["Unit"]["After"][0].split()
    assert "network-online.target" in unit["Unit"]["Wants"][0].split()
    # A network file system: started with remote-fs.target, after the cache disk is mounted.
    assert unit["Unit"]["Before"] == ["remote-fs.target"] and unit["Install"]["WantedBy"] == ["remote-fs.target"]
    assert unit["Unit"]["RequiresMountsFor"] == ["/var/cache/cachefs/%i"]
    assert service["Type"] == ["notify"]
    assert service["EnvironmentFile"] == ["/etc/cachefs/%i.env"]
    exec_start = service["ExecStart"][0]
    assert exec_start.startswith(f"{UNIT_PREFIX}/bin/cachefs mount ")
    assert re.search(r"/cachefs mount \$\{CACHEFS_HUB_URL\} %f --cache-dir /var/cache/cachefs/%i ", exec_start)
    assert "--foreground" in exec_start.split() and exec_start.endswith("$CACHEFS_ARGS")
    assert service["ExecStop"][0].endswith("/cachefs unmount %f")
    assert service["Restart"] == ["on-failure"]
    assert service["DeviceAllow"] == ["/dev/fuse rw"]
    # The mount must be visible outside the service: no private mount namespace.
    assert MOUNT_NAMESPACE_OPTIONS.isdisjoint(service), MOUNT_NAMESPACE_OPTIONS & set(service)


def test_example_env_files_define_what_the_units_use() -> None:
    escaped = run_tool(require_tool("systemd-escape"), "--path", "/mnt/data")
    assert escaped.stdout.strip() == "mnt-data"  # the example instance, /etc/cachefs/mnt-data.env
    for unit, env_file in [(HUB_UNIT, "hub.env"), (SPOKE_UNIT, "mnt-data.env")]:
        used = set(re.findall(r"\$\{?([A-Z_]+)\}?", "\n".join(parse_unit(unit)["Service"]["ExecStart"])))
        defined = {
            line.partition("=")[0]
            for line in (SYSTEMD / env_file).read_text().splitlines()
            if line and not line.startswith("#")
        }
        assert used and used <= defined, f"{env_file} lacks {used - defined}"


def test_sysusers_creates_the_hub_user(tmp_path: Path) -> None:
    sysusers = require_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    result = run_tool(sysusers, f"--root={tmp_path}", SYSTEMD / "cachefs-sysusers.conf")
    assert result.returncode == 0, result.stderr
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    assert users["cachefs"][6] in ("/usr/sbin/nologin", "/sbin/nologin")  # a system user without a shell
    assert int(users["cachefs"][2]) < 1000


def test_tmpfiles_give_the_hubs_secrets_to_its_user(tmp_path: Path) -> None:
    """hub.tokens and hub.key belong to cachefs with mode 0600 (the hub refuses anything
    group or others may read), hub.crt is public; absent files are left alone."""
    (tmp_path / "etc" / "cachefs").mkdir(parents=True)
    run_tool(require_tool("systemd-sysusers"), f"--root={tmp_path}", SYSTEMD / "cachefs-sysusers.conf")
    for name in ("hub.tokens", "hub.crt"):
        (tmp_path / "etc" / "cachefs" / name).write_text("x")
        (tmp_path / "etc" / "cachefs" / name).chmod(0o664)
    result = run_tool(require_tool("systemd-tmpfiles"), f"--root={tmp_path}", "--create", SYSTEMD / "cachefs-tmpfiles.conf")
    assert result.returncode == 0, result.stderr
    cachefs_uid = int(next(line for line in (tmp_path / "etc" / "passwd").read_text().splitlines()
                           if line.startswith("cachefs:")).split(":")[2])
    tokens, cert = (tmp_path / "etc" / "cachefs" / name for name in ("hub.tokens", "hub.crt"))
    assert (tokens.stat().st_uid, stat.S_IMODE(tokens.stat().st_mode)) == (cachefs_uid, 0o600)
    assert (cert.stat().st_uid, stat.S_IMODE(cert.stat().st_mode)) == (0, 0o644)
    assert not (tmp_path / "etc" / "cachefs" / "hub.key").exists()
    # The hub's files keep the names deploy/systemd/hub.env gives them.
    hub_args = next(line for line in (SYSTEMD / "hub.env").read_text().splitlines() if line.startswith("CACHEFS_HUB_ARGS="))
    configured = set(re.findall(r"/etc/cachefs/[\w.-]+", hub_args))
    assert configured == {"/etc/cachefs/hub.tokens", "/etc/cachefs/hub.crt", "/etc/cachefs/hub.key"}
    assert configured <= set(re.findall(r"/etc/cachefs/[\w.-]+", (SYSTEMD / "cachefs-tmpfiles.conf").read_text()))


# -- the units' privileges, applied with setpriv -------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="capability bounding sets apply to root")


@needs_root
def test_hub_serves_with_the_units_privileges(dataset: Path) -> None:
    """No capabilities, no new privileges, no writable+executable memory."""
    proc = subprocess.Popen(
        [*unit_privileges(HUB_UNIT), sys.executable, "-m", "hubserver", "serve", "--root", str(dataset),
         "--listen", "127.0.0.1:0"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=hub_env(),
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        readable, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline() if readable else ""
        if not line.startswith("cachefs-hub listening on "):
            proc.kill()
            pytest.fail(f"the hub did not start with the unit's privileges: {line!r}\n{proc.stderr.read()}")
        url = line.split(" on ", 1)[1].strip()
        shard = sorted((dataset / "shards").iterdir())[0]
        record = fetch_manifest(url).file(f"shards/{shard.name}")
        block_url = f"{url}/v1/files/{record['i']}?v={record['v']}"
        request = urllib.request.Request(block_url, headers={"Range": "bytes=0-99999"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 206 and answer.read() == shard.read_bytes()[:100000]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@needs_root
def test_spoke_mounts_with_the_units_privileges(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    """Only CAP_SYS_ADMIN, no new privileges, no writable+executable memory:
    mount, read, unmount."""
    mountpoint, cache_dir = tmp_path / "mnt", tmp_path / "cache"
    mountpoint.mkdir()
    prefix = unit_privileges(SPOKE_UNIT)
    assert "+sys_admin" in prefix[1]
    cachefs = [*prefix, sys.executable, "-m", "cachefs"]
    try:
        result = subprocess.run(
            [*cachefs, "mount", hub.url, str(mountpoint), "--cache-dir", str(cache_dir), "--fetch-timeout", "10"],
            capture_output=True, text=True, timeout=60, env=hub_env(), stdin=subprocess.DEVNULL, check=False,
        )
        assert result.returncode == 0, result.stderr
        for relative in source_files(dataset)[:20]:
            assert (mountpoint / relative).read_bytes() == (dataset / relative).read_bytes(), relative
        result = subprocess.run(
            [*cachefs, "unmount", str(mountpoint)],
            capture_output=True, text=True, timeout=60, env=hub_env(), stdin=subprocess.DEVNULL, check=False,
        )
        assert result.returncode == 0, result.stderr
        assert not is_mounted(mountpoint)
    finally:
        SpokeMount(mountpoint, cache_dir, daemon_pid(cache_dir)).unmount()


# -- mount.cachefs ------------------------------------------------------------------


def run_helper(*args: str | os.PathLike[str], cachefs_bin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = hub_env()
    env["CACHEFS_BIN"] = cachefs_bin if cachefs_bin is not None else str(cachefs_executable("cachefs"))
    return run_tool(MOUNT_HELPER, *args, env=env)


def test_mount_helper_mounts_and_unmounts(hub: HubProcess, dataset: Path, tmp_path: Path) -> None:
    mountpoint, cache_dir = tmp_path / "data", tmp_path / "cache"
    mountpoint.mkdir()
    try:
        port = free_port()
        options = f"cache_dir={cache_dir},cache_size=64M,_netdev,metrics_listen=127.0.0.1:{port}"
        result = run_helper(hub.url, mountpoint, "-o", options)
        assert result.returncode == 0, result.stderr
        assert is_mounted(mountpoint)
        for relative in source_files(dataset)[:10]:
            assert (mountpoint / relative).read_bytes() == (dataset / relative).read_bytes(), relative
        stats = json.loads(os.getxattr(mountpoint, "user.cachefs.stats"))
        assert stats["cache_capacity_bytes"] == 64 * 1024 * 1024  # cache_size=64M reached the daemon
        assert "cachefs_reads_total" in scrape_metric_names(f"http://127.0.0.1:{port}/metrics")  # metrics_listen too
        unmounted = run_cachefs("unmount", mountpoint)
        assert unmounted.returncode == 0, unmounted.stderr
        assert not is_mounted(mountpoint)
    finally:
        SpokeMount(mountpoint, cache_dir, daemon_pid(cache_dir)).unmount()


def test_mount_helper_translates_fstab_options(tmp_path: Path) -> None:
    """-f (fake) -v: the `cachefs mount` command the options become, nothing mounted."""
    options = ",".join([
        "defaults", "_netdev", "nofail", "noauto", "rw", "user", "x-systemd.automount", "x-systemd.idle-timeout=60",
        "comment=cachefs", "cache_dir=/var/cache/cachefs", "cache_size=500G", "block_size=4M", "max_connections=32",
        "readahead_blocks=4", "fetch_timeout=45", "mount_timeout=600", "cache_size=600G", "debug", "allow_other",
        "prefetch_siblings=0", "refresh_interval=300", "manifest_wait=90", "metrics_listen=127.0.0.1:9478", "token_file=/etc/t",
        "ca_file=/etc/ca.pem", "tls_cert=/etc/c.pem", "tls_key=/etc/k.pem", "config=/etc/cachefs/data.toml",
        "uid=nobody", "gid=4242", "file_mode=0640", "dir_mode=0750", "default_permissions", "max_read=131072", "ro",
        "x-systemd.requires-mounts-for=/var/cache/cachefs", "nopassthrough", "reverify_interval=3600", "reverify_rate=32M",
    ])
    result = run_helper("-f", "-v", "http://hub:8470", tmp_path / "mnt", "-o", options, "-n", "-t", "fuse.cachefs")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    cachefs = cachefs_executable("cachefs")
    assert result.stdout.strip() == (
        f"mount.cachefs: running: {cachefs} mount http://hub:8470 {tmp_path / 'mnt'} --cache-dir /var/cache/cachefs "
        "--cache-size 600G --block-size 4M --max-connections 32 --readahead-blocks 4 --fetch-timeout 45 "
        "--prefetch-siblings 0 --refresh-interval 300 --manifest-wait 90 --mount-timeout 600 --metrics-listen 127.0.0.1:9478 "
        "--token-file /etc/t --ca-file /etc/ca.pem --tls-cert /etc/c.pem --tls-key /etc/k.pem "
        "--uid nobody --gid 4242 --file-mode 0640 --dir-mode 0750 --config /etc/cachefs/data.toml "
        "--reverify-interval 3600 --reverify-rate 32M --allow-other --no-passthrough --debug"
    )
    assert not (tmp_path / "mnt").exists()
    for order, flag in ((["nopassthrough", "passthrough"], "--passthrough"),
                        (["passthrough", "nopassthrough"], "--no-passthrough"),
                        (["allow_other", "noallow_other"], "--no-allow-other"),
                        (["nonfs_export", "nfs_export"], "--nfs-export"),
                        (["debug", "nodebug"], "--no-debug")):  # the last one wins
        result = run_helper("-f", "-v", "http://hub:8470", tmp_path / "mnt", "-o", ",".join(["cache_dir=/c", *order]))
        assert result.returncode == 0 and result.stdout.strip().endswith(f"--cache-dir /c {flag}"), result.stdout


def test_mount_helper_passes_every_tier_node_in_order(tmp_path: Path) -> None:
    """tier=URL names one node each time: all of them are passed on, in their order."""
    options = "cache_dir=/c,tier=http://tier-1:8470,tier_slice=256K,tier=http://tier-0:8470,tier=http://tier-2:8470"
    result = run_helper("-f", "-v", "http://hub:8470", tmp_path / "mnt", "-o", options)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(
        "--cache-dir /c --tier http://tier-1:8470 --tier http://tier-0:8470 --tier http://tier-2:8470 --tier-slice 256K"
    )


def test_mount_helper_knows_every_cachefs_mount_option() -> None:
    """Each `cachefs mount` option has its fstab form (but the ones that make
    no sense for mount(8): --foreground, the mountpoint, the hub)."""
    result = run_cachefs("mount", "--help")
    cli_options = set(re.findall(r"--([a-z][a-z-]+)", result.stdout)) - {"help", "foreground"}
    helper = MOUNT_HELPER.read_text()
    translated = set(re.findall(r'": "--([a-z-]+)",', helper))
    assert cli_options == translated, f"not in mount.cachefs: {cli_options - translated}"


def test_mount_helper_sloppy_ignores_unknown_options(tmp_path: Path) -> None:
    result = run_helper("http://hub:8470", tmp_path, "-s", "-f", "-o", "cache_dir=/c,colour=blue")
    assert result.returncode == 0
    assert result.stderr == "mount.cachefs: warning: ignoring unknown option 'colour'\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["-o", "cache_dir=/c,colour=blue"], "unknown option 'colour'"),
        (["-o", "cache_dir=/c,token=S3CRET"], "unknown option 'token' ("),  # the name only: a value may be a secret
        (["-o", "cache_size=1G"], "option cache_dir=DIR is required"),
        (["-o", "cache_size=1G,config"], "option config needs a value"),
        (["-o", "cache_dir=/c,cache_size"], "option cache_size needs a value"),
        (["-o", "cache_dir=/c,cache_size="], "option cache_size needs a value"),
        (["-o", "cache_dir=/c,debug=1"], "option debug takes no value"),
        (["-x", "-o", "cache_dir=/c"], "option -x not recognized"),
        (["-t", "nfs", "-o", "cache_dir=/c"], "file system type 'nfs' is not fuse.cachefs"),
        (["-t", "fuse.sshfs", "-o", "cache_dir=/c"], "file system type 'fuse.sshfs' is not fuse.cachefs"),
        (["extra", "-o", "cache_dir=/c"], "expected HUB_URL and MOUNTPOINT, got 3 arguments"),
    ],
)
def test_mount_helper_usage_errors_exit_1(args: list[str], message: str, tmp_path: Path) -> None:
    """mount(8): exit code 1 is "incorrect invocation"; one line, no traceback."""
    result = run_helper("http://hub:8470", tmp_path, *args)
    assert result.returncode == 1
    assert result.stderr.startswith(f"mount.cachefs: {message}")
    assert result.stderr.count("\n") == 1, result.stderr
    assert not is_mounted(tmp_path)


@pytest.mark.parametrize("option, message", [
    ("cache_size=lots", "invalid size 'lots'"),
    ("gid=no-such-group-here", "unknown group 'no-such-group-here'"),
    ("max_connections=many", "argument --max-connections: invalid int value: 'many'"),
])
def test_mount_helper_values_cachefs_refuses_exit_1(hub: HubProcess, tmp_path: Path, option: str, message: str) -> None:
    """A value only `cachefs mount` can judge is still incorrect invocation (1), not a failed mount (32)."""
    (tmp_path / "mnt").mkdir()
    result = run_helper(hub.url, tmp_path / "mnt", "-t", "fuse.cachefs", "-o", f"cache_dir={tmp_path / 'cache'},{option}")
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not is_mounted(tmp_path / "mnt")


def test_mount_helper_without_cachefs_exits_2(tmp_path: Path) -> None:
    """mount(8): exit code 2 is "system error"."""
    result = run_helper("http://hub:8470", tmp_path, "-o", "cache_dir=/c", cachefs_bin=str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr == f"mount.cachefs: CACHEFS_BIN={tmp_path / 'missing'} is not an executable file\n"


def test_mount_helper_failed_mount_exits_32(hub: HubProcess, tmp_path: Path) -> None:
    """mount(8): exit code 32 is "mount failure"; cachefs's own message is shown."""
    result = run_helper(hub.url, tmp_path / "no-such-dir", "-o", f"cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 32
    assert result.stderr.startswith("cachefs: error: ") and "no-such-dir" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


# -- Prometheus and Grafana ---------------------------------------------------------


def scrape_metric_names(url: str) -> set[str]:
    """The metric families an exporter serves (counters under both names)."""
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)) | {
        f"{name}_total" for name in re.findall(r"^# TYPE (\S+) counter$", text, re.MULTILINE)
    }


@pytest.fixture(scope="module")
def known_metric_names(hub: HubProcess, dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every metric family a running hub and a running spoke export."""
    port = free_port()
    with mounted_spoke(hub.url, tmp_path_factory.mktemp("metrics"), ["--metrics-listen", f"127.0.0.1:{port}"]) as spoke:
        (spoke.mountpoint / source_files(dataset)[0]).read_bytes()  # so that every histogram has samples
        spoke_names = scrape_metric_names(f"http://127.0.0.1:{port}/metrics")
    assert SPOKE_METRICS <= spoke_names, f"the spoke no longer exports {SPOKE_METRICS - spoke_names}"
    return spoke_names | scrape_metric_names(hub.url + "/metrics")


def metric_names(expr: str) -> set[str]:
    """cachefs and standard process metric names in a PromQL expression;
    histogram series (_bucket, _sum, _count) are named by their family."""
    expr = re.sub(r"\b[a-z_]+:[a-z0-9_:]+", "", expr)  # recording rules (level:metric:operations)
    names = set(re.findall(r"\b(?:cachefs|process)_[a-z_]+\b", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_prometheus_config_and_rules_check() -> None:
    result = run_tool(require_tool("promtool"), "check", "config", PROMETHEUS / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "alerts.yml" in result.stdout  # the rule file was found and checked with it


def test_every_alert_fires_in_promtool_unit_tests() -> None:
    result = run_tool(require_tool("promtool"), "test", "rules", PROMETHEUS / "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fired = {
        case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if not case.get("exp_alerts")
    }
    names = {rule["alert"] for rule in alert_rules()}
    assert names <= fired, f"alerts never shown firing: {names - fired}"
    assert names <= quiet, f"alerts never shown staying quiet: {names - quiet}"


def test_alerts_are_complete(known_metric_names: set[str]) -> None:
    rules = alert_rules()
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    recordings = {rule["record"]: rule["expr"] for group in groups for rule in group["rules"] if "record" in rule}
    names = {rule["alert"] for rule in rules}
    assert {"CachefsHubDown", "CachefsHitRatioFalling", "CachefsCacheNearlyFull", "CachefsCorruptBlocks",
            "CachefsFetchLatencyHigh", "CachefsReadsFailing", "CachefsFetchesGivenUp", "CachefsReadStalls",
            "CachefsStoreErrors", "CachefsSpokeHubErrors", "CachefsFileDescriptorsRunningOut"} <= names
    known = known_metric_names
    for rule in rules:
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert metric_names(rule["expr"]) <= known, f"{rule['alert']}: unknown {metric_names(rule['expr']) - known}"
        recorded = set(re.findall(r"\b[a-z_]+:[a-z0-9_:]+", rule["expr"]))
        assert recorded <= set(recordings), f"{rule['alert']}: no recording rule {recorded - set(recordings)}"
    for expr in recordings.values():
        assert metric_names(expr) and metric_names(expr) <= known, expr


def test_every_metric_and_alert_is_documented(known_metric_names: set[str]) -> None:
    """docs/monitoring.md names every metric a live spoke exports and every
    alert; docs/protocol.md every metric of a live hub."""
    monitoring = (REPO_ROOT / "docs" / "monitoring.md").read_text()
    protocol = (REPO_ROOT / "docs" / "protocol.md").read_text()

    def undocumented(names: set[str], text: str) -> set[str]:
        return {name for name in names if not re.search(rf"`{name}[`{{]", text)}

    exported = {name for name in known_metric_names if not name.endswith("_total_total")}
    hub = {name for name in exported if name.startswith("cachefs_hub_")}
    spoke = {name for name in exported if name.startswith("cachefs_")} - hub
    assert len(spoke) > 30 and len(hub) > 10
    assert not undocumented(spoke | {"process_resident_memory_bytes"}, monitoring)
    assert not undocumented(hub, protocol)
    assert not undocumented({rule["alert"] for rule in alert_rules()}, monitoring)


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def test_dashboard_is_a_grafana_dashboard(known_metric_names: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    panels = list(dashboard_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        columns, rows = range(grid["x"], grid["x"] + grid["w"]), range(grid["y"], grid["y"] + grid["h"])
        area = {(x, y) for x in columns for y in rows}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            assert all(target["refId"] for target in panel["targets"])
    known = known_metric_names
    queries = dashboard_queries()
    for title, expr in queries:
        # process_* series only next to a cachefs one (`and on (instance)`): other exporters have them too.
        assert any(name.startswith("cachefs_") for name in metric_names(expr)), f"{title}: no cachefs metric in {expr!r}"
        assert metric_names(expr) <= known, f"{title}: unknown {metric_names(expr) - known}"
    # The cold-to-warm story: throughput, hit ratio, WAN bytes, latency quantiles, hub bytes.
    everything = "\n".join(expr for _, expr in queries)
    for needle in [
        "rate(cachefs_read_bytes_total", "rate(cachefs_block_hits_total", "rate(cachefs_block_misses_total",
        "rate(cachefs_fetched_bytes_total", "histogram_quantile(0.5, sum by (instance, le) (rate(cachefs_read_duration",
        "histogram_quantile(0.99, sum by (instance, le) (rate(cachefs_read_duration",
        "rate(cachefs_hub_sent_bytes_total",
        "sum by (instance)",
        # What went wrong: failed reads, stalls, cache and hub errors; and the processes.
        "increase(cachefs_fuse_errors_total", "increase(cachefs_fetch_failures_total",
        "histogram_quantile(0.99, sum by (instance, le) (rate(cachefs_read_stall_seconds_bucket",
        "increase(cachefs_store_errors_total", "increase(cachefs_upstream_errors_total",
        'cachefs_hub_requests_total{instance=~"$hub", status=~"5.."}',
        "process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds",
    ]:
        assert needle in everything, needle


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every query (as a recording rule), with Grafana's
    variables replaced by what they expand to."""
    replacements = {"$__rate_interval": "5m", "$instance": ".*", "$hub": ".*"}
    rules = []
    for index, (_title, expr) in enumerate(dashboard_queries()):
        for variable, value in replacements.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    rules_file = tmp_path / "dashboard_rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_tool(require_tool("promtool"), "check", "rules", rules_file)
    assert result.returncode == 0, result.stdout + result.stderr


# Dashboard queries that have no series while nothing fails: 5xx answers and
# 401s are counted by labels that only exist once one happened.
EMPTY_WHILE_HEALTHY = ('status=~"5.."', "cachefs_hub_auth_failures_total")
PROMETHEUS_START_TIMEOUT_S = 30.0
ALERT_TIMEOUT_S = 30.0


@contextmanager
def running_prometheus(workdir: Path, targets: dict[str, str], hub_ca: Path) -> Iterator[str]:
    """Debian's Prometheus on a loopback port with the shipped prometheus.yml
    and alerts.yml, scraping `targets` (job name -> host:port) every second
    instead of the example hosts, the hub's certificate checked against
    `hub_ca`; yields its URL."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS / name) for name in config["rule_files"]]
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        if "tls_config" in job:
            job["tls_config"]["ca_file"] = str(hub_ca)
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(workdir / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [require_tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def prometheus_query(url: str, expr: str) -> list[dict[str, Any]]:
    """The series an instant query returns (empty while Prometheus is not up yet)."""
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as answer:
            body = json.load(answer)
    except OSError:
        return []
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for_query(url: str, expr: str, done: Any, timeout_s: float) -> list[dict[str, Any]]:
    """Repeat `expr` until `done(result)`; the last result, or a failure at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = prometheus_query(url, expr)
        if done(result):
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{expr!r} still gives {result} after {timeout_s} s")
        time.sleep(0.5)


def firing(url: str) -> set[str]:
    return {series["metric"]["alertname"] for series in prometheus_query(url, 'ALERTS{alertstate="firing"}')}


def test_live_prometheus_fills_the_dashboard_and_alerts_on_a_failed_read(dataset: Path, tmp_path: Path) -> None:
    """A real Prometheus scrapes a real hub and spoke with the shipped scrape
    config and rules: every dashboard query returns series, nothing alerts
    while all is well, and the spoke's first failed read raises
    CachefsReadsFailing and CachefsFetchesGivenUp."""
    spoke_port = free_port()
    cert, key = tmp_path / "hub.crt", tmp_path / "hub.key"  # HTTPS, as operations.md sets the hub up
    subprocess.run([require_tool("openssl"), "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=TOOL_TIMEOUT_S)
    args = ["--fetch-timeout", "1", "--prefetch-siblings", "0", "--metrics-listen", f"127.0.0.1:{spoke_port}",
            "--ca-file", str(cert)]
    with (
        running_hub(dataset, ["--tls-cert", str(cert), "--tls-key", str(key)]) as hub,
        mounted_spoke(hub.url, tmp_path, args) as spoke,
        running_prometheus(tmp_path / "prometheus", {"cachefs-hub": f"{hub.host}:{hub.port}",
                                                     "cachefs-spoke": f"127.0.0.1:{spoke_port}"}, cert) as prometheus,
    ):
        with open(spoke.mountpoint / "shards/shard-000.bin", "rb") as shard:
            assert shard.read(10) == (dataset / "shards/shard-000.bin").read_bytes()[:10]
        # Both targets up, with enough samples for a rate over 10 s.
        wait_for_query(prometheus, "count_over_time(up[10s]) >= 4 and up == 1", lambda result: len(result) == 2,
                       PROMETHEUS_START_TIMEOUT_S)
        for title, expr in dashboard_queries():
            for variable, value in {"$__rate_interval": "10s", "$instance": ".*", "$hub": ".*"}.items():
                expr = expr.replace(variable, value)
            result = prometheus_query(prometheus, expr)
            assert result or any(needle in expr for needle in EMPTY_WHILE_HEALTHY), f"{title}: no series for {expr}"
        # One series per process, hub and spoke; the memory panel also has the spoke's held block bytes, one per owner.
        for panel, series in {"Memory (RSS)": [1, 1, 4], "CPU": [1, 1], "File descriptors in use": [1, 1]}.items():
            exprs = [expr.replace("$__rate_interval", "10s").replace("$instance", ".*").replace("$hub", ".*")
                     for title, expr in dashboard_queries() if title == panel]
            assert [len(prometheus_query(prometheus, expr)) for expr in exprs] == series, panel
        assert prometheus_query(prometheus, "ALERTS") == []

        hub.stop()
        with open(spoke.mountpoint / "shards/shard-002.bin", "rb") as shard, pytest.raises(OSError):
            shard.read(10)
        wait_for_query(prometheus, 'ALERTS{alertstate="firing"}',
                       lambda _: {"CachefsReadsFailing", "CachefsFetchesGivenUp"} <= firing(prometheus), ALERT_TIMEOUT_S)


# -- Kubernetes ---------------------------------------------------------------------


def kubernetes_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}"
    return matches[0]


def test_kubernetes_manifests_match_the_api_schema() -> None:
    import kubernetes_validate

    version = kubernetes_validate.utils.latest_version()
    for obj in kubernetes_objects():
        kubernetes_validate.validate(obj, version, strict=True)  # raises on unknown or missing fields


def test_kubernetes_manifests_fit_together() -> None:
    objects = kubernetes_objects()
    for obj in objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    manifests = sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == manifests
    config = find(objects, "ConfigMap", "cachefs-config")["data"]

    for kind, name in [("Deployment", "cachefs-hub"), ("DaemonSet", "cachefs-spoke")]:
        workload = find(objects, kind, name)
        template = workload["spec"]["template"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name}: selector does not match its pods"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"].isdigit()
        (container,) = template["spec"]["containers"]
        assert {"name": "cachefs-config"} == container["envFrom"][0]["configMapRef"]
        command = " ".join(container.get("command", []) + container.get("args", []))
        provided = set(config) | {env["name"] for env in container.get("env", [])}
        used = set(re.findall(r"\$\(?([A-Z_]+)\)?", command))
        assert used <= provided, f"{name}: undefined {used - provided}"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert set(mounts) <= set(volumes), name

    service = find(objects, "Service", "cachefs-hub")
    hub = find(objects, "Deployment", "cachefs-hub")["spec"]["template"]
    assert service["spec"]["selector"].items() <= hub["metadata"]["labels"].items()
    (hub_container,) = hub["spec"]["containers"]
    data_mount = next(m for m in hub_container["volumeMounts"] if m["mountPath"] == config["CACHEFS_HUB_ROOT"])
    assert data_mount["readOnly"] is True
    data_volume = next(v for v in hub["spec"]["volumes"] if v["name"] == data_mount["name"])
    assert data_volume.get("persistentVolumeClaim", {}).get("readOnly") is True or "hostPath" in data_volume
    assert hub_container["securityContext"]["readOnlyRootFilesystem"] is True
    assert hub_container["securityContext"]["allowPrivilegeEscalation"] is False

    spoke = find(objects, "DaemonSet", "cachefs-spoke")["spec"]["template"]
    (spoke_container,) = spoke["spec"]["containers"]
    assert spoke_container["securityContext"]["privileged"] is True
    mounts = {m["mountPath"]: m for m in spoke_container["volumeMounts"]}
    volumes = {v["name"]: v for v in spoke["spec"]["volumes"]}
    mountpoint = next(e["value"] for e in spoke_container["env"] if e["name"] == "CACHEFS_MOUNTPOINT")
    shared = [m for path, m in mounts.items() if mountpoint.startswith(path.rstrip("/") + "/")]
    assert len(shared) == 1 and shared[0]["mountPropagation"] == "Bidirectional"
    assert "hostPath" in volumes[shared[0]["name"]]
    assert volumes[mounts["/dev/fuse"]["name"]]["hostPath"]["type"] == "CharDevice"
    assert "hostPath" in volumes[mounts["/cache"]["name"]]
    assert "--cache-dir /cache" in " ".join(spoke_container["args"])
    assert spoke_container["lifecycle"]["preStop"]["exec"]["command"] == ["cachefs", "unmount", mountpoint]
    assert spoke_container["livenessProbe"]["exec"]["command"][:3] == ["cachefs", "stats", mountpoint]


def test_kubernetes_settings_for_production() -> None:
    """The spoke keeps the tuned defaults, is scheduled before the training pods, and never
    creates its cache dir (an unmounted NVMe would fill the root disk); the one hub replica
    is replaced, not rolled, on a volume that may be ReadWriteOnce."""
    objects = kubernetes_objects()
    spoke = find(objects, "DaemonSet", "cachefs-spoke")["spec"]["template"]["spec"]
    (container,) = spoke["containers"]
    command = " ".join(container["args"]) + " " + " ".join(find(objects, "ConfigMap", "cachefs-config")["data"].values())
    for tuned in ("--max-connections", "--readahead-blocks", "--block-size", "--fetch-timeout", "--prefetch-siblings"):
        assert tuned not in command, f"{tuned} overrides the tuned default"
    assert spoke["priorityClassName"] == "system-node-critical"
    cache_volume = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/cache")
    assert next(v for v in spoke["volumes"] if v["name"] == cache_volume)["hostPath"]["type"] == "Directory"
    hub = find(objects, "Deployment", "cachefs-hub")
    assert hub["spec"]["replicas"] == 1 and hub["spec"]["strategy"] == {"type": "Recreate"}
    # The images are the Containerfile's targets.
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", CONTAINERFILE.read_text(), re.MULTILINE))
    (hub_container,) = hub["spec"]["template"]["spec"]["containers"]
    for image, target in [(container["image"], "spoke"), (hub_container["image"], "hub")]:
        assert image.rsplit("/", 1)[1].split(":")[0] == f"cachefs-{target}" and target in targets, image


@needs_root
def test_the_kubernetes_hub_serves_only_token_holders_from_its_secrets_as_mounted(dataset: Path,
                                                                                  tmp_path: Path) -> None:
    """hub.yaml's container args, run here without capabilities in the pod's group, with its
    Secrets' files as the kubelet mounts them (root:fsGroup, defaultMode 0440)."""
    hub = find(kubernetes_objects(), "Deployment", "cachefs-hub")["spec"]["template"]["spec"]
    (container,) = hub["containers"]
    group = hub["securityContext"]["fsGroup"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    secrets = {volume["name"]: volume["secret"] for volume in hub["volumes"] if "secret" in volume}
    assert set(secrets) == {"tls", "tokens"}
    token = "spokes-secret-" + "x" * 32
    files = {"tls": {}, "tokens": {"hub.tokens": f"spokes-us-west-2:{token}\n"}}
    subprocess.run([require_tool("openssl"), "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-days", "2", "-subj", "/CN=hub.example.internal", "-keyout", str(tmp_path / "tls.key"),
                    "-out", str(tmp_path / "tls.crt")], check=True, capture_output=True, timeout=TOOL_TIMEOUT_S)
    files["tls"] = {name: (tmp_path / name).read_text() for name in ("tls.crt", "tls.key")}
    args = " ".join(container["args"]).replace("$(CACHEFS_HUB_ROOT)", str(dataset))
    args = args.replace("$(CACHEFS_HUB_LISTEN)", "127.0.0.1:0")
    for name, secret in secrets.items():
        directory = tmp_path / name
        directory.mkdir()
        for file_name, text in files[name].items():
            (directory / file_name).write_text(text)
            os.chown(directory / file_name, 0, group)
            os.chmod(directory / file_name, secret["defaultMode"])
        args = args.replace(mounts[name] + "/", f"{directory}/")
    assert args.split()[0] == "serve" and "--token-file" in args
    wrapper = [require_tool("setpriv"), f"--regid={group}", f"--groups={group}", "--bounding-set=-all",
               "--inh-caps=-all", "--no-new-privs"]
    with running_hub(dataset, args.split()[1:], wrapper=wrapper) as running:
        context = ssl.create_default_context(cafile=tmp_path / "tls.crt")
        context.check_hostname = False
        for headers, status in [({}, 401), ({"Authorization": f"Bearer {token}"}, 200)]:
            request = urllib.request.Request(f"{running.url}/v1/manifest", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=30, context=context) as answer:
                    assert answer.status == status
            except urllib.error.HTTPError as exc:
                assert exc.code == status


def test_kubernetes_scrape_job_uses_the_alert_job_names() -> None:
    config = yaml.safe_load((KUBERNETES / "prometheus-scrape-job.yml").read_text())
    (job,) = config["scrape_configs"]
    relabel = next(r for r in job["relabel_configs"] if r.get("target_label") == "job")
    assert re.fullmatch(relabel["regex"], "cachefs-hub") and re.fullmatch(relabel["regex"], "cachefs-spoke")
    jobs = set(re.findall(r'job="([^"]+)"', (PROMETHEUS / "alerts.yml").read_text()))
    assert jobs == {"cachefs-hub", "cachefs-spoke"}
    static = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]
    assert {job["job_name"] for job in static} == jobs


# -- the operator docs --------------------------------------------------------------


def test_operator_docs_name_existing_files_and_explain_every_alert() -> None:
    docs = {name: (REPO_ROOT / "docs" / name).read_text() for name in ("operations.md", "monitoring.md")}
    for name, text in docs.items():
        for path in set(re.findall(r"(?<![\w/.-])((?:deploy|systemd)/[\w./@-]+\w)", text)):
            assert (REPO_ROOT / path).exists(), f"docs/{name} names a missing {path}"
    alerts_section = docs["monitoring.md"][docs["monitoring.md"].index("\n## Alerts") :]
    for alert in alert_rules():
        assert f"`{alert['alert']}`" in alerts_section, f"docs/monitoring.md does not explain {alert['alert']}"

