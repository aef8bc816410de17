"""The daemon's resident memory after a burst of reads: once idle, it gives its heap's free pages back
(daemon.trim_when_idle: its policy with a fake trim, then a real mount)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import time
from pathlib import Path

import pytest
import trio
from hub_helpers import running_hub
from mount_helpers import mounted_spoke

from cachefs.bench.memory import status_kib
from cachefs.daemon import IDLE_TRIM_S, trim_when_idle
from cachefs.metrics import Stats

MiB = 1 << 20
FILE_MIB = 256
READERS = 4


def _rss_anon_kib(pid: int) -> int:
    kib = status_kib(pid, "RssAnon")
    assert kib is not None, f"no RssAnon in /proc/{pid}/status"
    return kib


def _digest_of_range(path: Path, start: int, length: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as file:
        file.seek(start)
        while length > 0:
            chunk = file.read(min(MiB, length))
            assert chunk, f"{path} ended early"
            digest.update(chunk)
            length -= len(chunk)
    return digest.hexdigest()


def test_an_idle_daemon_gives_back_the_heap_of_a_cold_read(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    with open(root / "big.bin", "wb") as out:
        for _ in range(FILE_MIB):
            out.write(os.urandom(MiB))
    quarter = FILE_MIB * MiB // READERS
    with running_hub(root) as hub, mounted_spoke(hub.url, tmp_path) as spoke:
        pid = spoke.stats()["pid"]
        idle_kib = _rss_anon_kib(pid)
        with concurrent.futures.ThreadPoolExecutor(READERS) as pool:  # four cold streams, as `seq4` reads
            read = list(pool.map(lambda i: _digest_of_range(spoke.mountpoint / "big.bin", i * quarter, quarter),
                                 range(READERS)))
        assert read == [_digest_of_range(root / "big.bin", i * quarter, quarter) for i in range(READERS)]
        grown_kib = _rss_anon_kib(pid) - idle_kib
        deadline = time.monotonic() + 15
        while (now_kib := _rss_anon_kib(pid) - idle_kib) > 32 << 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert now_kib <= 32 << 10, f"{now_kib >> 10} MiB more than before the read, {grown_kib >> 10} MiB right after it"


@pytest.mark.trio
async def test_the_heap_is_trimmed_once_per_idle_stretch_and_never_while_busy(autojump_clock: trio.abc.Clock) -> None:
    stats = Stats()
    trims: list[None] = []

    async def trim() -> None:
        trims.append(None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trim_when_idle, stats, trim)
        for _ in range(10):  # busy: bytes served every half interval
            stats.read_bytes += 1
            await trio.sleep(IDLE_TRIM_S / 2)
        assert trims == []
        await trio.sleep(IDLE_TRIM_S * 3)
        assert len(trims) == 1
        await trio.sleep(IDLE_TRIM_S * 10)  # still idle: nothing more to give back
        assert len(trims) == 1
        stats.fetched_bytes += 1  # a fetch, then idle again
        await trio.sleep(IDLE_TRIM_S * 3)
        assert len(trims) == 2
        nursery.cancel_scope.cancel()
