"""Several mounts (tenants) sharing one cache dir: the ledger they publish their use in,
and the policy that gives each its allowance of the shared --cache-size.

Each tenant owns a directory of its own (its index, data files, lock) and
evicts only its own blocks; the default tenant (a mount without --tenant)
owns the cache dir itself, laid out as a cache dir of one mount always was.
Each publishes a record (`tenant.record` in its directory, with a checksum)
of its size limits, bytes used, recent use and counters; a tenant is live
while it holds the flock on its `lock` file. docs/shared-cache.md has the
guarantees and their cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import UsageError

TENANTS_DIR = "tenants"
RECORD_FILE = "tenant.record"
LOCK_FILE = "lock"
DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")


def validate_tenant(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(f"invalid --tenant {name!r}: 1 to 32 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name


def tenant_dir(cache_dir: Path, name: str) -> Path:
    """Where a tenant's own files live: the default tenant's are the cache dir's top level."""
    return cache_dir if name == DEFAULT_TENANT else cache_dir / TENANTS_DIR / name


@dataclasses.dataclass(frozen=True, slots=True)
class TenantRecord:
    """What a tenant publishes about itself (and, read back, whether it is live)."""

    name: str
    pid: int
    pool_bytes: int  # its --cache-size: the size of the shared cache
    min_bytes: int  # guaranteed while it is mounted
    max_bytes: int  # its cap
    used_bytes: int
    pinned_bytes: int
    want_bytes: int  # what it could use now: its cap while it is turning blocks away, else a little over what it holds
    use_rate: float  # bytes read from the mount per second, recently
    block_hits: int = 0
    block_misses: int = 0
    fetched_bytes: int = 0
    updated: float = 0.0  # time.time() of the record
    live: bool = False  # not stored: whether its daemon holds its lock

    def to_bytes(self) -> bytes:
        """The record, a checksum of it (a reader may catch it half rewritten), padded to RECORD_BYTES."""
        text = json.dumps({field: getattr(self, field) for field in _STORED}, sort_keys=True).encode()
        return f"{zlib.crc32(text):08x} ".encode() + text.ljust(RECORD_BYTES - 9)

    @classmethod
    def from_bytes(cls, data: bytes, live: bool) -> TenantRecord | None:
        """The record, None if it is not whole (being rewritten, or not written yet)."""
        crc, _, text = data.partition(b" ")
        text = text.rstrip()
        if len(crc) != 8 or crc != f"{zlib.crc32(text):08x}".encode():
            return None
        values = json.loads(text)
        return cls(**{field: values[field] for field in _STORED}, live=live)


_STORED = [field.name for field in dataclasses.fields(TenantRecord) if field.name != "live"]
# A record is rewritten in place (a rename per cache insert cost ~0.3 ms on ext4): one pwrite of this size.
RECORD_BYTES = 1024
READ_ATTEMPTS = 5  # a record caught half rewritten is read again; a writer rewrites it within microseconds


def allowances(pool_bytes: int, tenants: Iterable[TenantRecord]) -> dict[str, int]:
    """The bytes each tenant may hold, together at most `pool_bytes`.

    Every live tenant first gets its minimum (and what it has pinned), up to
    its cap; a tenant not mounted has no minimum. The rest goes to tenants
    that read recently, in proportion to how much they read, each up to what
    it wants (its cap while it is turning blocks away); what they leave goes
    to the others up to what they want (idle or unmounted tenants keep what
    they hold while nobody needs the room), and what is still left to the
    live tenants up to their caps, so a tenant alone may use the whole size.
    A tenant over its allowance evicts its own blocks: eviction takes from
    tenants above their minimum first.
    """
    tenants = list(tenants)
    given = {t.name: min(t.max_bytes, max(t.min_bytes if t.live else 0, t.pinned_bytes)) for t in tenants}
    room = pool_bytes - sum(given.values())
    # A tenant not mounted cannot grow: it wants at most what it holds.
    want = {t.name: max(given[t.name], min(t.max_bytes, t.want_bytes if t.live else t.used_bytes)) for t in tenants}
    live = [t for t in tenants if t.live]
    active = {t.name: t.use_rate for t in live if t.use_rate > 0}
    room = _share(room, given, want, active)
    room = _share(room, given, want, {t.name: 1.0 for t in tenants})
    _share(room, given, {t.name: t.max_bytes for t in tenants}, active or {t.name: 1.0 for t in live})
    return given


def _share(room: int, given: dict[str, int], want: dict[str, int], weights: dict[str, float]) -> int:
    """Water-fill `room` into `given` by weight, each up to its `want`; returns what is left."""
    hungry = {name: weight for name, weight in weights.items() if given[name] < want[name]}
    while room > 0 and hungry:
        total = sum(hungry.values())
        handed = 0
        for name, weight in sorted(hungry.items()):
            part = min(want[name] - given[name], max(1, int(room * weight / total)))
            part = min(part, room - handed)
            given[name] += part
            handed += part
        room -= handed
        hungry = {name: weight for name, weight in hungry.items() if given[name] < want[name]}
        if handed == 0:
            break
    return room


class Ledger:
    """The tenants of one cache dir, read from their directories and records."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        # The listing, kept while the tenants directory is unchanged (a new tenant's
        # directory changes its mtime): listing it at every cache insert cost more than the rest.
        self._listed: tuple[tuple[int, int, int, bool], dict[str, Path]] | None = None

    def tenant_dirs(self) -> dict[str, Path]:
        """Every tenant that has a directory here (the default one if the cache dir holds its files)."""
        try:
            info = os.stat(self.cache_dir / TENANTS_DIR)
            state = (info.st_ino, info.st_mtime_ns, info.st_nlink, (self.cache_dir / LOCK_FILE).exists())
        except FileNotFoundError:
            state = (0, 0, 0, (self.cache_dir / LOCK_FILE).exists())
        if self._listed is not None and self._listed[0] == state:
            return self._listed[1]
        found = {}
        if state[3]:
            found[DEFAULT_TENANT] = self.cache_dir
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(os.scandir(self.cache_dir / TENANTS_DIR), key=lambda e: e.name):
                if entry.is_dir() and _NAME.fullmatch(entry.name):
                    found[entry.name] = Path(entry.path)
        self._listed = (state, found)
        return found

    def records(self, *, check_live: bool = True) -> list[TenantRecord]:
        """The record of each tenant that published one; `live` is checked with its lock when asked."""
        records = []
        for name, directory in self.tenant_dirs().items():
            record = self.read(directory, live=check_live and is_live(directory))
            if record is not None and record.name == name:
                records.append(record)
        return records

    @staticmethod
    def read(directory: Path, live: bool = False) -> TenantRecord | None:
        """The tenant's record, None if it has not published one (or it cannot be read)."""
        try:
            fd = os.open(f"{directory}/{RECORD_FILE}", os.O_RDONLY)
        except OSError:
            return None
        try:
            for _attempt in range(READ_ATTEMPTS):
                record = TenantRecord.from_bytes(os.pread(fd, RECORD_BYTES, 0), live)
                if record is not None:
                    return record
        except (OSError, ValueError, TypeError, KeyError):
            pass
        finally:
            os.close(fd)
        return None

    @staticmethod
    def publish(directory: Path, record: TenantRecord) -> None:
        """Rewrite the tenant's record in place (no fsync: a record lost in a crash is rewritten within a second)."""
        data = record.to_bytes()
        if len(data) > RECORD_BYTES:
            raise OSError(f"a tenant record of {len(data)} bytes does not fit in {RECORD_BYTES}")
        fd = os.open(f"{directory}/{RECORD_FILE}", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)


def is_live(directory: Path) -> bool:
    """Whether a daemon holds the tenant's lock (a probe for a moment; CacheDirLock retries past it)."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a probe's own lock
    return False


@contextlib.contextmanager
def locked_if_dead(directory: Path) -> Iterator[bool]:
    """Hold a dead tenant's lock for the block (True), so it cannot mount meanwhile; False if it is live."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
