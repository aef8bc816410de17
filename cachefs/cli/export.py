"""The NFS-Ganesha configuration that exports one cachefs mount read-only over NFSv3/v4.

Ganesha's VFS backend serves the mount through the kernel's file handles
(name_to_handle_at/open_by_handle_at), which FUSE supports because the spoke
answers lookups of "." and ".." and its inode numbers are hashes of the path.
Run by `cachefs export --run`, Ganesha gets ganesha_fsid.c preloaded, so its
handles name the mount by a fixed id rather than by its device number, and
survive a remount of the spoke.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import xxhash

from ..errors import UsageError
from ..fs.mountpoints import FSTYPE, find_mount

GANESHA = "ganesha.nfsd"
FSID_SHIM_SOURCE = Path(__file__).with_name("ganesha_fsid.c")
FSID_SHIM = "ganesha-fsid.so"
PROTOCOLS = (3, 4)
SQUASH_MODES = ("root_squash", "all_squash", "no_root_squash")


@dataclasses.dataclass(frozen=True, slots=True)
class ExportConfig:
    mountpoint: Path
    clients: tuple[str, ...]  # addresses, CIDR networks or "*"
    protocols: tuple[int, ...] = PROTOCOLS
    pseudo: str = ""  # NFSv4 path of the export; "" = the mountpoint's path
    export_id: int = 1
    squash: str = "root_squash"
    nfs_port: int = 2049
    mount_port: int = 20048  # fixed, so a firewall can let NFSv3 clients reach mountd
    bind_addr: str | None = None  # None: every address
    # Seconds after a restart in which NFSv4 clients reclaim their opens (0: none, new
    # opens are served at once). At least the lease, as NFSv4 requires.
    grace_period_s: int = 40
    lease_s: int = 30
    state_dir: Path = Path("/var/lib/cachefs/nfs")  # NFSv4 client records, kept across restarts


def check_exportable(mountpoint: Path) -> None:
    """A cachefs mount that Ganesha, acting as each client's user, may read (allow_other)."""
    mount = find_mount(mountpoint)
    if mount is None:
        raise UsageError(f"{mountpoint} is not mounted")
    if mount.fstype != FSTYPE:
        raise UsageError(f"{mountpoint} is not a cachefs mount ({mount.fstype})")
    if "allow_other" not in mount.super_options and os.geteuid() == 0:
        raise UsageError(
            f"{mountpoint} was mounted without --allow-other: the NFS server reads as each client's "
            "user and would be refused; remount with --allow-other"
        )


def parse_clients(text: str) -> tuple[str, ...]:
    """"10.0.0.0/8,192.168.1.7" -> its entries, each checked; "*" allows every client."""
    clients = tuple(part.strip() for part in text.split(",") if part.strip())
    if not clients:
        raise UsageError("--clients needs at least one address, network or '*'")
    for client in clients:
        if client == "*":
            continue
        _address, slash, prefix = client.partition("/")
        try:
            ipaddress.ip_network(client, strict=False)
            if slash and not prefix.isdigit():  # a netmask (10.0.0.0/255.0.0.0): Ganesha drops the entry
                raise ValueError(client)
        except ValueError:
            raise UsageError(f"invalid client {client!r} in --clients: an IP address, a CIDR network "
                             "(10.0.0.0/8) or '*'") from None
    return clients


def parse_protocols(text: str) -> tuple[int, ...]:
    try:
        protocols = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        protocols = ()
    if not protocols or any(version not in PROTOCOLS for version in protocols):
        raise UsageError(f"invalid --protocols {text!r}: 3, 4 or 3,4")
    return protocols


def _quoted(value: str) -> str:
    if any(char in value for char in '"\\\n'):
        raise UsageError(f"unsupported character in {value!r}")
    return f'"{value}"'


def ganesha_config(config: ExportConfig) -> str:
    """The whole ganesha.conf: one read-only export of the mount, over TCP only."""
    path = os.path.abspath(config.mountpoint)
    pseudo = config.pseudo or path
    if not pseudo.startswith("/"):
        raise UsageError(f"invalid --pseudo {pseudo!r}: an absolute path")
    protocols = ", ".join(map(str, config.protocols))
    core = [
        f"NFS_Port = {config.nfs_port};",
        f"MNT_Port = {config.mount_port};",
        f"Protocols = {protocols};",
        "Enable_NLM = false;",  # read-only: no locks to manage
        "Enable_RQUOTA = false;",
        "Enable_UDP = false;",
    ]
    if config.bind_addr:
        core.append(f"Bind_addr = {config.bind_addr};")
    grace = (
        ["Graceless = true;"]
        if config.grace_period_s == 0
        else [f"Grace_Period = {max(config.grace_period_s, config.lease_s)};"]
    )
    nfsv4 = [
        *grace,
        f"Lease_Lifetime = {config.lease_s};",
        f"RecoveryRoot = {_quoted(str(config.state_dir))};",
        "Only_Numeric_Owners = true;",  # uids as numbers: no idmapd needed on either side
    ]
    clients = ", ".join(config.clients)
    export = [
        f"Export_Id = {config.export_id};",
        f"Path = {_quoted(path)};",
        f"Pseudo = {_quoted(pseudo)};",
        "Access_Type = None;",  # only the CLIENT block below may read
        f"Squash = {config.squash};",
        f"Protocols = {protocols};",
        "Transports = TCP;",
        "SecType = sys;",
        # Ganesha's own attribute cache: a file version's never change (a new version is a
        # new handle); a directory's may show a refresh this much later.
        "Attr_Expiration_Time = 60;",
        f"CLIENT {{ Clients = {clients}; Access_Type = RO; }}",
        "FSAL { Name = VFS; }",
    ]
    return "\n".join([
        "# Written by `cachefs export`: a read-only NFS export of a cachefs mount.",
        f"# For handles that survive a remount, Ganesha runs with LD_PRELOAD=ganesha-fsid.so,"
        f" CACHEFS_NFS_MOUNT={path} and CACHEFS_NFS_FSID={export_fsid(Path(path))} (cachefs export --run does).",
        _block("NFS_CORE_PARAM", core),
        _block("NFSV4", nfsv4),
        _block("NFS_KRB5", ["Active_krb5 = false;"]),
        _block("EXPORT", export),
        # No directory entries cached in Ganesha: a refresh that rewrites a file leaves its
        # directory's time as it was, so Ganesha would go on answering the name with the
        # old version's handle; the kernel, which the daemon tells, answers with the new one.
        _block("MDCACHE", ["Dir_Chunk = 0;"]),
        _block("LOG", ["Default_Log_Level = EVENT;"]),
    ])


def _block(name: str, lines: list[str]) -> str:
    body = "".join(f"    {line}\n" for line in lines)
    return f"{name} {{\n{body}}}\n"


def ganesha_command(config_file: Path, pid_file: Path) -> list[str]:
    """Ganesha in the foreground, logging to stderr (the journal under systemd)."""
    binary = shutil.which(GANESHA) or shutil.which(GANESHA, path="/usr/bin:/usr/sbin")
    if binary is None:
        raise UsageError(f"{GANESHA} not found: install NFS-Ganesha (Debian: nfs-ganesha nfs-ganesha-vfs)")
    return [binary, "-F", "-f", str(config_file), "-L", "STDERR", "-p", str(pid_file)]


def export_fsid(mountpoint: Path) -> str:
    """The file system id Ganesha's handles carry for this mount: 16 hex digits, the same
    for every mount on the path."""
    return xxhash.xxh3_64_hexdigest(os.fsencode(os.path.abspath(mountpoint)))


def build_fsid_shim(directory: Path) -> Path:
    """ganesha_fsid.c compiled into `directory` (kept while the source is unchanged)."""
    target = directory / FSID_SHIM
    if target.exists() and target.stat().st_mtime >= FSID_SHIM_SOURCE.stat().st_mtime:
        return target
    compiler = shutil.which("cc")
    if compiler is None:
        raise UsageError(
            "no C compiler (cc) to build the file system id shim: install gcc, or pass --no-stable-handles "
            "(NFS handles then go stale whenever the spoke remounts)"
        )
    partial = directory / f".{FSID_SHIM}.{os.getpid()}"
    result = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(FSID_SHIM_SOURCE), "-ldl"],
        capture_output=True, text=True, timeout=120,
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        first_line = (result.stderr.strip().splitlines() or ["no output"])[0]
        raise UsageError(f"cannot build the file system id shim with {compiler}: {first_line}")
    os.replace(partial, target)
    return target


def ganesha_environment(mountpoint: Path, shim: Path | None) -> dict[str, str]:
    """Ganesha's environment: this one, plus the preloaded shim and the mount's fixed id."""
    environment = dict(os.environ)
    if shim is not None:
        preload = environment.get("LD_PRELOAD")
        environment["LD_PRELOAD"] = f"{shim}:{preload}" if preload else str(shim)
        environment["CACHEFS_NFS_MOUNT"] = os.path.abspath(mountpoint)
        environment["CACHEFS_NFS_FSID"] = export_fsid(mountpoint)
    return environment
