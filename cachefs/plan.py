"""Tell cachefs what a training loop will read next. Standard library only; safe to import anywhere.

Two ways, each two lines. Hand over the epoch's reads in order, as
(path, offset, length) tuples (length None: to the end of the file):

    with cachefs.plan.submit(reads, epoch=epoch):
        train_one_epoch()

or wrap the sampler, and the plan is derived from it each epoch
(`reads_of(index)` gives the reads of one sample):

    sampler = cachefs.plan.PlanSampler(RandomSampler(dataset), reads_of=dataset.reads_of)
    loader = DataLoader(dataset, sampler=sampler, batch_size=64, num_workers=8)

The paths must lie in one cachefs mount. The plan is streamed to the mount's
daemon over its control socket as it is generated, never built as one
object, and is followed by the daemon for as long as the returned `Plan` is
open: closing it (leaving the `with` block, `Plan.close()`, the process
ending) cancels it. A PlanSampler keeps each epoch's plan open until the
next epoch starts. Outside a cachefs mount, a PlanSampler warns once and
samples as its inner sampler would; `submit` raises PlanError.
"""

from __future__ import annotations

import itertools
import json
import logging
import numbers
import os
import pickle
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any

from .fs.mountpoints import FSTYPE, list_mounts

if TYPE_CHECKING:  # checked as the plain iterable it is, the same with torch installed or not
    _SamplerBase = object
else:
    try:  # A real torch Sampler when torch is there; nothing is imported otherwise.
        from torch.utils.data import Sampler as _SamplerBase
    except ImportError:
        _SamplerBase = object

__all__ = ["Plan", "PlanError", "PlanSampler", "find_mount", "mark_epoch", "submit"]

log = logging.getLogger(__name__)

STATS_XATTR = "user.cachefs.stats"
SOCKET_NAME = "control.sock"
READS_PER_LINE = 4096
CONNECT_TIMEOUT_S = 10.0
# How long the daemon may take to accept the plan's end (it validates as it goes).
ACCEPT_TIMEOUT_S = 120.0
SPOOL_CHUNK = 65536

Read = tuple[Any, int, int | None]  # (path, offset, length or None)


class PlanError(Exception):
    """The plan could not be handed over; the message says why in one line."""


# -- finding the mount ---------------------------------------------------------------------


def _cachefs_mountpoints() -> list[str]:
    """Mountpoints of cachefs mounts, longest first (from /proc/self/mountinfo)."""
    try:
        mounts = list_mounts()
    except OSError as exc:
        raise PlanError(f"cannot read the mount table: {exc.strerror}") from None
    return sorted((mount.mountpoint for mount in mounts if mount.fstype == FSTYPE), key=len, reverse=True)


def find_mount(path: str | os.PathLike[str], mountpoints: list[str] | None = None) -> tuple[str, str]:
    """(mountpoint, path relative to it) of the cachefs mount holding `path` (symlinks resolved)."""
    absolute = os.path.realpath(os.fspath(path))
    for mountpoint in mountpoints if mountpoints is not None else _cachefs_mountpoints():
        if absolute == mountpoint:
            return mountpoint, ""
        prefix = mountpoint.rstrip("/") + "/"
        if absolute.startswith(prefix):
            return mountpoint, absolute[len(prefix):]
    raise PlanError(f"{absolute} is not inside a cachefs mount")


def _control_socket(mountpoint: str) -> str:
    try:
        stats = json.loads(os.getxattr(mountpoint, STATS_XATTR))
    except OSError as exc:
        raise PlanError(f"cannot reach the cachefs daemon of {mountpoint}: {exc.strerror}") from None
    return os.path.join(stats["cache_dir"], SOCKET_NAME)


# -- the plan -----------------------------------------------------------------------------


class Plan:
    """A plan the daemon follows while this object is open."""

    def __init__(self, sock: socket.socket, replies: IO[bytes], accepted: dict[str, Any]) -> None:
        self._sock: socket.socket | None = sock
        self._replies = replies
        self.info = accepted  # what the daemon said on accepting it: plan id, epoch, reads, blocks
        self.id: int = accepted.get("plan", 0)
        self.epoch: int = accepted.get("epoch", 0)
        self.reads: int = accepted.get("reads", 0)
        self.blocks: int = accepted.get("blocks", 0)

    @property
    def advice(self) -> str | None:
        """One line of advice on the mount's block size for this plan's reads, or None if it fits them.

        A cold epoch fetches a whole block for each sample it reads first;
        with blocks much larger than the samples, the first batches need most
        blocks at once and the link carries bytes not read until much later.
        """
        advised = self.info.get("advised_block_size")
        read_bytes, use_bytes = self.info.get("read_bytes", 0), self.info.get("block_use_bytes", 0)
        if not advised or not use_bytes or not self.reads:
            return None
        return (f"cachefs: this plan's reads ({read_bytes / self.reads / 1024:.0f} KiB on average) use "
                f"{100 * read_bytes / use_bytes:.0f} % of the {_size(self.info.get('block_size', 0))} blocks they "
                f"need; a cold epoch fetches whole blocks: mount with --block-size {_size(advised)}")

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Cancel the plan (its prefetch stops); a no-op if it ended already."""
        if self._sock is None:
            return
        try:
            self._replies.close()
            self._sock.close()
        finally:
            self._sock = None

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<cachefs Plan {self.id} epoch {self.epoch}: {self.reads} reads, {self.blocks} blocks, {state}>"


def _size(size_bytes: int) -> str:
    """A size as `cachefs mount --block-size` takes it: 256K, 1M."""
    for unit, suffix in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if size_bytes >= unit and size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return f"{size_bytes} bytes"


def submit(reads: Iterable[Read], *, epoch: int | None = None, timeout_s: float = ACCEPT_TIMEOUT_S) -> Plan:
    """Stream `reads` (consumed lazily) to the daemon of their mount; returns the open Plan.

    `epoch` numbers the plan for the per-epoch statistics (None: the one
    after the daemon's last). Raises PlanError when the paths are not in one
    cachefs mount, a file is not in the mounted snapshot, or the daemon
    cannot be reached.
    """
    iterator = iter(reads)
    first = next(iterator, None)
    if first is None:
        raise PlanError("an empty plan: give at least one read (or use mark_epoch)")
    path = os.path.abspath(os.fspath(_checked_read(first)[0]))
    # The mount of the file's directory (the file may be missing: the daemon says so), or of a
    # directory named as a file (the mount's root: the daemon says it is not a file).
    within = path if os.path.isdir(path) else os.path.dirname(path)
    return _submit(itertools.chain([first], iterator), find_mount(within)[0], epoch, timeout_s)


def mark_epoch(path: str | os.PathLike[str], epoch: int | None = None) -> None:
    """Start a new epoch in the per-epoch statistics of the mount holding `path`, without a plan."""
    mountpoint, _relative = find_mount(path)
    _submit(iter(()), mountpoint, epoch, ACCEPT_TIMEOUT_S).close()


def _submit(reads: Iterator[Read], mountpoint: str, epoch: int | None, timeout_s: float) -> Plan:
    mountpoints = _cachefs_mountpoints()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    path = _control_socket(mountpoint)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise PlanError(f"cannot reach the cachefs daemon at {path}: {exc.strerror or exc}") from None
    sock.settimeout(timeout_s)
    replies = sock.makefile("rb")
    try:
        try:
            _send(sock, {"command": "plan", "epoch": epoch})
            _stream(sock, reads, mountpoint, mountpoints)
            _send(sock, {"end": True})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused the plan part-way: its reply says why
        accepted = _accepted(replies)
    except BaseException:
        replies.close()
        sock.close()
        raise
    return Plan(sock, replies, accepted)


def _stream(sock: socket.socket, reads: Iterator[Read], mountpoint: str, mountpoints: list[str]) -> None:
    files: dict[str, int] = {}  # path relative to the mountpoint -> index in the plan's file table
    by_name: dict[Any, int] = {}  # the path as given -> index
    directories: dict[str, str] = {}  # directory -> its path relative to the mountpoint
    new_files: list[str] = []
    batch: list[list[Any]] = []
    for read in reads:
        path, offset, length = _checked_read(read)
        index = by_name.get(path)
        if index is None:
            name = os.fspath(path)
            if os.path.realpath(name) == mountpoint:
                raise PlanError(f"not a regular file: {name} (the mount's root)")
            directory, base = os.path.split(os.path.abspath(name))
            relative_dir = directories.get(directory)
            if relative_dir is None:  # symlinks resolved once per directory
                owner, relative_dir = find_mount(directory, mountpoints)
                if owner != mountpoint:
                    raise PlanError(f"{name} is not in the cachefs mount {mountpoint}: a plan covers one mount")
                directories[directory] = relative_dir
            relative = f"{relative_dir}/{base}" if relative_dir else base
            index = files.get(relative)
            if index is None:
                index = files[relative] = len(files)
                new_files.append(relative)
            by_name[path] = index
        batch.append([index, offset, length])
        if len(batch) >= READS_PER_LINE:
            _send(sock, {"files": new_files, "reads": batch})
            new_files, batch = [], []
    if batch or new_files:
        _send(sock, {"files": new_files, "reads": batch})


def _checked_read(read: Any) -> tuple[str | os.PathLike[str], int, int | None]:
    """One (path, offset, length) of a plan, or a PlanError that says what is wrong with it."""
    if isinstance(read, (str, bytes, os.PathLike)):  # a reads_of that returned one read, not a list of them
        raise PlanError(f"a read is (path, offset, length), not the path {read!r:.100} alone: "
                        "give an iterable of reads (a PlanSampler's reads_of returns a list)")
    try:
        path, offset, length = read
    except (TypeError, ValueError):
        raise PlanError(f"a read is (path, offset, length), not {read!r:.100}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise PlanError(f"a read's path is a str or an os.PathLike, not {path!r:.100}")
    if not _whole(offset) or (length is not None and not _whole(length)):
        raise PlanError(f"a read's offset and length are whole numbers (length None: to the end), "
                        f"not {offset!r:.40} and {length!r:.40}")
    return path, int(offset), None if length is None else int(length)


def _whole(number: Any) -> bool:
    """An int (numpy's too), or a float without a fraction; never a bool."""
    if isinstance(number, bool):
        return False
    return isinstance(number, numbers.Integral) or (isinstance(number, float) and number.is_integer())


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def _accepted(replies: IO[bytes]) -> dict[str, Any]:
    """Wait for the daemon to accept the plan (a progress line) or refuse it."""
    try:
        for line in replies:
            message = json.loads(line)
            if "progress" in message:
                return dict(message["progress"])
            if not message.get("ok"):
                raise PlanError(message.get("error", "the daemon refused the plan"))
            return dict(message.get("result", {}))  # an empty plan, finished at once
    except TimeoutError:
        raise PlanError("the cachefs daemon did not accept the plan in time") from None
    except (OSError, ValueError) as exc:
        raise PlanError(f"lost the cachefs daemon while sending the plan: {exc}") from None
    raise PlanError("the cachefs daemon closed the connection without accepting the plan")


# -- the sampler wrapper --------------------------------------------------------------------


class _Spool:
    """One epoch's indices in order: a temporary file beyond the first chunk, replayable by several readers."""

    def __init__(self) -> None:
        self._file: IO[bytes] | None = None
        self._chunks: list[tuple[int, int]] = []  # (offset, length) of pickled chunks
        self._size = 0
        self._tail: list[Any] = []

    def append(self, index: Any) -> None:
        self._tail.append(index)
        if len(self._tail) >= SPOOL_CHUNK:
            data = pickle.dumps(self._tail, protocol=pickle.HIGHEST_PROTOCOL)
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="cachefs-plan-")
            os.pwrite(self._file.fileno(), data, self._size)
            self._chunks.append((self._size, len(data)))
            self._size += len(data)
            self._tail = []

    def replay(self) -> Iterator[Any]:
        for offset, length in self._chunks:
            assert self._file is not None
            yield from pickle.loads(os.pread(self._file.fileno(), length, offset))
        yield from self._tail

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class PlanSampler(_SamplerBase):
    """A sampler that tells cachefs, at the start of each epoch, what the epoch will read.

    Wraps any sampler (anything iterable that yields dataset indices; a
    torch Sampler, DistributedSampler, a list). At each `iter()` it draws
    the epoch's indices from the inner sampler into a temporary file,
    closes the previous epoch's plan, hands the new one to cachefs
    (`reads_of(index)` -> iterable of (path, offset, length) for each
    index) and yields the indices. `set_epoch` is passed on to the inner
    sampler and numbers the plans; without it epochs count from
    `first_epoch`.

    By default the plan streams in a background thread while the epoch
    already runs (the daemon prefetches along it from its first lines, and
    follows the readers along it once it has all of it), and a
    failure to hand it over is logged once; training goes on unplanned.
    With `strict`, the first index is yielded only once the daemon has the
    whole plan, and failures raise PlanError. When the mount's block size is
    much larger than the samples (`Plan.advice`), it logs that advice once.
    """

    def __init__(
        self,
        sampler: Iterable[Any],
        reads_of: Callable[[Any], Iterable[Read]],
        *,
        first_epoch: int = 1,
        strict: bool = False,
    ) -> None:
        self.sampler = sampler
        self.reads_of = reads_of
        self.strict = strict
        self.plan: Plan | None = None
        self._epoch = first_epoch
        self._epoch_set = False
        self._warned = False
        self._advised = False
        self._lock = threading.Lock()
        self._generation = 0
        self._spool: _Spool | None = None
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._epoch_set = True
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def close(self) -> None:
        """Cancel the current epoch's plan."""
        with self._lock:
            self._generation += 1
            plan, self.plan = self.plan, None
            spool, self._spool = self._spool, None
        if plan is not None:
            plan.close()
        if spool is not None:
            spool.close()

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        if not self._epoch_set:
            self._epoch += 1
        self._epoch_set = False
        spool = _Spool()
        for index in self.sampler:
            spool.append(index)
        self.close()
        with self._lock:
            generation = self._generation
            self._spool = spool
        if self.strict:
            self._hand_over(spool, epoch, generation)
        else:
            self._thread = threading.Thread(target=self._hand_over, args=(spool, epoch, generation), daemon=True,
                                            name=f"cachefs-plan-{epoch}")
            self._thread.start()
        yield from spool.replay()

    def wait(self, timeout_s: float | None = None) -> Plan | None:
        """Wait until the current epoch's plan has been handed over; returns it (None if that failed)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self.plan

    def _hand_over(self, spool: _Spool, epoch: int, generation: int) -> None:
        """Stream the epoch's reads to the daemon; keep the plan open unless a newer epoch began meanwhile."""
        try:
            submitted = submit((read for index in spool.replay() for read in self.reads_of(index)), epoch=epoch)
        except Exception as exc:  # also a bug in reads_of (the caller's code): one warning, not a thread's traceback
            with self._lock:
                current = generation == self._generation
            expected = isinstance(exc, (PlanError, OSError, ValueError))
            if self.strict and current:
                if not expected:
                    raise  # the caller's bug, with its traceback
                raise PlanError(str(exc)) from None
            if current and not self._warned:
                reason = exc if expected else f"{type(exc).__name__}: {exc}"
                log.warning("cachefs: training without a plan: %s", reason)
                self._warned = True
            return
        advice = submitted.advice
        if advice is not None and not self._advised:
            log.warning("%s", advice)
            self._advised = True
        plan: Plan | None = submitted
        with self._lock:
            if generation == self._generation:
                self.plan, plan = plan, None
        if plan is not None:
            plan.close()  # a newer epoch started while this one was being handed over
