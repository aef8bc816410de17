"""Mount options as one frozen dataclass, with every default explained."""

from __future__ import annotations

import dataclasses
import enum
import grp
import os
import pwd
import re
import stat
import urllib.parse
from pathlib import Path

from .errors import UsageError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_UNITS = {"": 1, "B": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB, "P": 1024**5}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str, *, zero: bool = False) -> int:
    """Parse '512M', '10GiB', '1.5T' or '4096' into bytes (binary units); 0 only if `zero`."""
    match = _SIZE_RE.match(text)
    if not match:
        raise UsageError(f"invalid size {text!r}: use a number with an optional unit K, M, G or T (e.g. 10G)")
    number, unit = match.groups()
    size = int(float(number) * _UNITS[unit.upper()])
    if size < 0 or (size == 0 and not zero):
        raise UsageError(f"invalid size {text!r}: must be greater than zero")
    return size


def format_size(size_bytes: float) -> str:
    """Human-readable binary size, e.g. '1.5 GiB'."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class PassthroughMode(enum.Enum):
    """FUSE passthrough: where available (the default; a note if it is not), asked for
    (--passthrough; a warning if it is not available), or off (--no-passthrough)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclasses.dataclass(frozen=True, slots=True)
class HubURL:
    """A parsed http(s)://host:port[/prefix] address of a hub."""

    host: str
    port: int
    prefix: str
    tls: bool = False

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}{self.prefix}"


def parse_hub_url(text: str) -> HubURL:
    """Validate a hub URL (http or https; credentials never go in it, and a refused URL is
    shown without its user info and query, which might hold one)."""
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError as exc:  # an unclosed [IPv6 address]: the URL is not shown, it may hold a secret
        raise UsageError(f"invalid hub URL: {exc}") from None
    if "@" in parts.netloc:
        raise UsageError("credentials do not belong in the hub URL (they would show in `ps`): use --token-file")
    text = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))  # as shown in messages
    try:
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"invalid hub URL {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"invalid hub URL {text!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    if not parts.hostname:
        raise UsageError(f"invalid hub URL {text!r}: no host name")
    try:
        parts.hostname.encode("idna")  # what a connection will need of it (a label of 64+ characters cannot)
    except UnicodeError:
        raise UsageError(f"invalid hub URL {text!r}: the host name is not a valid DNS name") from None
    if parts.query or parts.fragment:
        raise UsageError(f"invalid hub URL {text!r}: no query or fragment allowed")
    tls = parts.scheme == "https"
    return HubURL(host=parts.hostname, port=port or (443 if tls else 80), prefix=parts.path.rstrip("/"), tls=tls)


def checked_token(token: str, source: str) -> str:
    """A bearer token as sent in a header: surrounding whitespace (a file's or a secret's
    last newline) dropped; anything but visible ASCII inside refused, never echoed."""
    token = token.strip()
    if not token or not all("!" <= char <= "~" for char in token):
        raise UsageError(f"the token in {source} is empty or holds characters an HTTP header cannot carry")
    return token


def read_option_file(path: Path, what: str, *, private: bool = False) -> bytes:
    """A file an option names, whole: a regular file, opened without waiting (a FIFO is
    refused, not read forever); `private`: a secret's (a token, a TLS key), which group and
    others must not be able to read."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as source:
            info = os.fstat(source.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UsageError(f"{what} {path} is not a regular file")
            if private and info.st_mode & 0o077:
                raise UsageError(f"{what} {path} is readable by group or others; chmod 600 it")
            return source.read()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror}") from None


def read_token(path: Path) -> str:
    """The bearer token in a file: its first non-empty, non-comment line."""
    text = read_option_file(path, "token file", private=True).decode("utf-8", "replace")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            token = line.split(":", 1)[1] if ":" in line and " " not in line.split(":", 1)[0] else line
            return checked_token(token, f"token file {path}")
    raise UsageError(f"token file {path} holds no token")


def parse_listen(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port)."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"invalid listen address {text!r}: expected HOST:PORT")
    return host, int(port)


def parse_tier(urls: list[str] | None, hub_url: HubURL) -> tuple[HubURL, ...]:
    """The --tier nodes, in order (their positions decide which node owns which slice)."""
    nodes = tuple(parse_hub_url(url) for url in urls or ())
    for index, node in enumerate(nodes):
        if node in nodes[:index]:
            raise UsageError(f"--tier {node} is given twice: each node once, in the same order on every spoke")
        if node == hub_url:
            raise UsageError(f"--tier {node} is the hub itself: name the regional cache nodes in front of it")
    return nodes


def validate_tier_slice(size_bytes: int) -> int:
    """nginx slices for the tier: powers of two from 64 KiB to 64 MiB, like blocks."""
    if size_bytes < 64 * KiB or size_bytes > 64 * MiB or size_bytes & (size_bytes - 1):
        raise UsageError(f"invalid --tier-slice {size_bytes}: must be a power of two from 64K to 64M (nginx `slice`)")
    return size_bytes


MIN_BLOCK_SIZE = 64 * KiB
MAX_BLOCK_SIZE = 64 * MiB


def validate_block_size(size_bytes: int) -> int:
    """Block sizes are powers of two from 64 KiB to 64 MiB."""
    if size_bytes < MIN_BLOCK_SIZE or size_bytes > MAX_BLOCK_SIZE or size_bytes & (size_bytes - 1):
        raise UsageError(f"invalid block size {size_bytes}: must be a power of two from 64K to 64M")
    return size_bytes


# uid_t and gid_t are 32 bits; (uid_t) -1 means "no change" to the kernel.
MAX_ID = (1 << 32) - 2


def _numeric_id(text: str, what: str) -> int | None:
    """A numeric uid or gid, in range; None if `text` is a name."""
    if not (text.isascii() and text.isdigit()):
        return None
    if int(text) > MAX_ID:
        raise UsageError(f"invalid {what} {text}: at most {MAX_ID}")
    return int(text)


def parse_user(text: str) -> int:
    """A user name or numeric uid -> uid."""
    if (uid := _numeric_id(text, "uid")) is not None:
        return uid
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise UsageError(f"unknown user {text!r}: give a user name or a numeric uid") from None


def parse_group(text: str) -> int:
    """A group name or numeric gid -> gid."""
    if (gid := _numeric_id(text, "gid")) is not None:
        return gid
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise UsageError(f"unknown group {text!r}: give a group name or a numeric gid") from None


def parse_mode(text: str) -> int:
    """Octal permission bits such as '0640' or '755'."""
    if not re.fullmatch(r"0?[0-7]{3}", text):
        raise UsageError(f"invalid mode {text!r}: octal permission bits such as 0640 or 0755")
    return int(text, 8)


@dataclasses.dataclass(frozen=True, slots=True)
class Ownership:
    """The owner and permission bits every entry of the mount shows; the kernel checks
    access against them (default_permissions)."""

    uid: int
    gid: int
    file_mode: int | None = None  # None: the hub's bits
    dir_mode: int | None = None

    def mode(self, is_dir: bool, is_file: bool, hub_mode: int) -> int:
        """Permission bits of an entry whose bits at the hub are `hub_mode` (symlinks keep theirs)."""
        if is_dir and self.dir_mode is not None:
            return self.dir_mode
        if is_file and self.file_mode is not None:
            return self.file_mode
        return hub_mode


@dataclasses.dataclass(frozen=True, slots=True)
class MountConfig:
    """Everything the spoke daemon needs to know."""

    hub_url: HubURL
    mountpoint: Path
    cache_dir: Path
    # 10 GiB: a modest default that fits any training node's NVMe; set it to
    # what the node can spare. With several tenants, the size of the cache dir
    # they share (each mounts with the same).
    cache_size_bytes: int = 10 * GiB
    # Several mounts may share one cache dir (`pool_dir`), each a tenant with
    # a directory of its own (`cache_dir`, cache/tenants.py). The default
    # tenant's files are the pool dir's top level, as with one mount per dir.
    pool_dir: Path | None = None  # None: cache_dir, this mount's own
    tenant: str = "default"
    # Guaranteed to this tenant while mounted: others never evict it below
    # this. 0: the tenant gets only what the others leave or do not use.
    cache_min_bytes: int = 0
    # This tenant's cap (None: the whole --cache-size).
    cache_max_bytes: int | None = None
    # 1 MiB: the kernel's largest FUSE read request, so one cached block serves
    # one request; large enough that a 60 ms RTT link moves ~17 MB per round
    # trip and connection, small enough that a random 16 KiB sample fetches
    # little waste. See docs/usage.md "Block size" for the measurement.
    block_size_bytes: int = 1 * MiB
    # Concurrent HTTP connections to the hub: HTTP/1.1 carries one request at a
    # time per connection, so many small files need many (docs/performance.md).
    max_connections: int = 64
    # A read that needs the hub fails with EIO within this long (plus up to a
    # second) without success, retries with backoff included, however many
    # requests the kernel makes for it (fs/failed_reads.py): bounded, never a hang.
    fetch_timeout_s: float = 30.0
    # TCP connect timeout for one attempt.
    connect_timeout_s: float = 5.0
    # How long the hub may stay silent within one response before the
    # attempt is abandoned and retried.
    read_timeout_s: float = 15.0
    # Largest read-ahead window per sequential reader, in blocks: 64 x 1 MiB
    # is the bandwidth-delay product of 1 GB/s at 60 ms RTT.
    readahead_blocks: int = 64
    # Read-ahead and a loader's plan may hold this many of the connections;
    # the rest stay free for demand misses, which so never queue behind them.
    # Read-ahead alone holds at most READAHEAD_RUNS_IN_FLIGHT (below: 16
    # runs of at most 4 MiB each).
    prefetch_connections: int = 24
    # Opening a small file prefetches this many files after it in its
    # directory: a directory-order walk then costs a round trip per batch,
    # not per file.
    sibling_prefetch_files: int = 128
    # Freshly used blocks kept in daemon memory, so the kernel's smaller
    # read requests into one block cost one disk read, not several (8: one
    # each for 8 readers; more cost memory and gained nothing).
    memory_blocks: int = 8
    # Seconds the kernel may cache names and attributes: a mount shows one
    # immutable snapshot, so these can be long.
    attr_timeout_s: float = 3600.0
    # Raised kernel readahead for the mount (KiB): big FUSE read requests.
    kernel_readahead_kb: int = 4096
    # FUSE requests the kernel keeps in flight in the background (its
    # readahead), 12 by default: 32 is as fast as 64 for several warm readers
    # and holds fewer demand fetches in memory (docs/performance.md).
    fuse_max_background: int = 32
    # Let the kernel read whole, verified cached files straight from the
    # cache's data files (FUSE passthrough; Linux >= 6.9, root, the pyfuse3
    # of scripts/install_passthrough_fuse.sh): local disk speed for warm
    # reads. On by default; without those, the daemon serves every read
    # (one log line). Those reads skip the per-read checksum check, so a file
    # is handed over only once verified whole, its data file is sealed
    # read-only and re-verified every reverify_interval_s (docs/usage.md).
    passthrough: PassthroughMode = PassthroughMode.AUTO
    # Re-hash each data file the kernel may read directly this long after its
    # last verification: a byte changed on disk after it is found within a
    # day (fs-verity, which would check every read, is not on every kernel).
    reverify_interval_s: float = 86400.0
    # ... at most this fast, so re-verification never takes the cache disk
    # from readers (64 MiB/s: a few percent of a local NVMe disk).
    reverify_rate_bytes: int = 64 * MiB
    # Poll the hub for a new generation every this many seconds and move to
    # it; None: only on `cachefs refresh` (a job sees one snapshot), or once
    # after a mount that came up on its stored snapshot (manifest_wait_s).
    refresh_interval_s: float | None = None
    # At mount, with a snapshot in the cache dir: how long to wait for the
    # hub's new manifest before mounting on the stored one (and loading the
    # new one in the background). A slow link must not outlast the mount.
    manifest_wait_s: float = 60.0
    # A regional tier of nginx caches (deploy/nginx/regional-cache.conf on
    # each) that file data and checksums come through, each slice from the
    # node that owns it (fetch/tier_client.py); empty: straight from the hub.
    tier_urls: tuple[HubURL, ...] = ()
    # The nodes' nginx `slice` size: a slice asked of two nodes would cross
    # the WAN twice. 1 MiB: the shipped config's `slice 1m`.
    tier_slice_bytes: int = 1 * MiB
    # Bearer token for the hub, read from a file (never from the command line).
    token: str | None = dataclasses.field(default=None, repr=False)
    # TLS: CA bundle to verify the hub with (None: the system CAs) and an
    # optional client certificate and key for mutual TLS.
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    # Prometheus /metrics endpoint (host, port); off unless asked for.
    metrics_listen: tuple[str, int] | None = None
    # Let other local users use the mount (FUSE allow_other). Off: only the
    # mounting user (and root) can; the hub's file modes are enforced either
    # way (default_permissions).
    allow_other: bool = False
    # Owner and group of every entry (None: the daemon's own, root under
    # systemd), and permission bits of every file and directory (None: the
    # hub's). With allow_other, `gid` and modes such as 0640 let one group of
    # local users read a dataset that others cannot.
    uid: int | None = None
    gid: int | None = None
    file_mode: int | None = None
    dir_mode: int | None = None
    # A file changed by a refresh gets a new FUSE generation, so file handles
    # of its old version (what an NFS server hands out) answer ESTALE rather
    # than read on in that version beside new attributes. Off: a handle opened
    # before a refresh keeps reading its version (an NFS server's cached one too).
    nfs_export: bool = False
    foreground: bool = False
    debug: bool = False


# Blocks per prefetch request (read-ahead, plans, warm-ups): 4 x 1 MiB keeps
# 64 MiB in flight on 16 connections.
COALESCE_BLOCKS = 4
# Plan prefetch and background fills fetch runs of up to this many bytes, and
# keep about PREFETCH_INFLIGHT_BYTES in flight, whatever the block size: a
# smaller block (sized to the samples) must not lower what the link carries.
# 12 MiB is 1.6x the bandwidth-delay product of 1 Gbit/s at 60 ms.
RUN_BYTES = 4 * MiB
PREFETCH_INFLIGHT_BYTES = 12 * MiB
# Read-ahead requests in flight at once (streams, fills and sibling batches
# together): the runs share the link and end at about the same time, so a
# stream moves about W / (RTT + W / link rate) with W of them in flight
# (docs/performance.md has the measurements behind 16).
READAHEAD_RUNS_IN_FLIGHT = 16

# The daemon's resident memory should stay under this, whatever it does
# (MISSION: a spoke shares its node with training jobs).
MEMORY_TARGET_BYTES = 200 * MiB
# What the daemon takes before it holds any block: the interpreter, its
# libraries, trio, the HTTP client and LMDB's pages in use (an idle mount).
BASELINE_BYTES = 40 * MiB


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Every bound on the block bytes the daemon holds in memory, derived from the options in one place.

    `total_bytes` adds them up as they can coincide: plan prefetch's share
    covers read-ahead's too (the planner leaves out what read-ahead holds),
    so the larger of the two counts.
    """

    block_size_bytes: int
    # Blocks readers used lately, kept so the kernel's smaller requests into one
    # block cost one disk read: memory_blocks of them (one each for 8 readers),
    # counted in blocks too, so a walk of small files keeps no more of them.
    demand_blocks: int
    demand_bytes: int
    # Demand fetches the kernel can have waiting at once: one block for each of
    # its background requests (fuse_max_background).
    demand_fetch_bytes: int
    # Fetched blocks waiting for the cache writer or being written: they bound
    # what a slow disk can make the daemon hold; fetchers then wait, never drop.
    write_queue_bytes: int
    # Read-ahead's requests in flight: READAHEAD_RUNS_IN_FLIGHT of them, each holding the
    # block it is receiving (a run's blocks go to the cache writer one by one as they arrive).
    read_ahead_runs_bytes: int
    # Blocks read ahead kept after their write until their first read (not in
    # the page cache: written with O_DIRECT), for this long at most; those held
    # `read_ahead_stale_s` make room for new ones (nobody is coming for them).
    read_ahead_held_bytes: int
    read_ahead_max_age_s: float
    read_ahead_stale_s: float
    # Plan prefetch: bytes in flight plus bytes held for their planned use,
    # with read-ahead's in flight and held counted against it too: twice the
    # bandwidth-delay product of 800 MB/s at 60 ms.
    plan_bytes: int
    target_bytes: int = MEMORY_TARGET_BYTES
    baseline_bytes: int = BASELINE_BYTES

    @property
    def write_batch_bytes(self) -> int:
        """The cache writer commits up to half its queue at once (one fsync for all)."""
        return self.write_queue_bytes // 2

    @property
    def read_ahead_bytes(self) -> int:
        """Read-ahead's runs in flight and the blocks it holds for their first read."""
        return self.read_ahead_runs_bytes + self.read_ahead_held_bytes

    @property
    def buffer_pool_bytes(self) -> int:
        """Bytes of each size class of the block buffer pools (buffers.py): every bound here, and one
        block more per FUSE request in flight (a cached block read from disk is held until its reply)."""
        return self.total_bytes() - self.baseline_bytes + self.demand_fetch_bytes

    def total_bytes(self) -> int:
        return (self.baseline_bytes + self.demand_bytes + self.demand_fetch_bytes + self.write_queue_bytes
                + max(self.plan_bytes, self.read_ahead_bytes))

    def over_target(self) -> str | None:
        """A one-line warning if the bounds add up to more than the target, else None."""
        total = self.total_bytes()
        if total <= self.target_bytes:
            return None
        return (f"the daemon's memory bounds add up to {format_size(total)} at a block size of "
                f"{format_size(self.block_size_bytes)}, over its target of {format_size(self.target_bytes)}: "
                "a smaller --block-size lowers them")


def run_blocks(block_size_bytes: int) -> int:
    """Blocks per plan prefetch or fill request: RUN_BYTES of them, at least COALESCE_BLOCKS."""
    return max(COALESCE_BLOCKS, RUN_BYTES // block_size_bytes)


def prefetch_connections(config: MountConfig) -> int:
    """Connections prefetch may hold: the configured number, more when blocks are so small that one
    block per request would keep less than PREFETCH_INFLIGHT_BYTES in flight (random samples are rarely
    adjacent); always 4 left for demand misses."""
    wanted = max(config.prefetch_connections, -(-PREFETCH_INFLIGHT_BYTES // config.block_size_bytes))
    return min(wanted, max(1, config.max_connections - 4))


def memory_budget(config: MountConfig) -> MemoryBudget:
    """The memory bounds of a mount with these options."""
    block = config.block_size_bytes
    return MemoryBudget(
        block_size_bytes=block,
        demand_blocks=config.memory_blocks,
        demand_bytes=config.memory_blocks * block,
        demand_fetch_bytes=config.fuse_max_background * block,
        write_queue_bytes=16 * MiB,
        read_ahead_runs_bytes=READAHEAD_RUNS_IN_FLIGHT * block,
        read_ahead_held_bytes=16 * MiB,
        read_ahead_max_age_s=30.0,
        read_ahead_stale_s=5.0,
        plan_bytes=96 * MiB,
    )
