"""The spoke's real read path (namespace, cache, fetcher, read-ahead, reader, planner) around a
FakeHub, for policy tests: a real LMDB namespace and BlockCache in a temp dir, no mount."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import trio
from fakes import FakeHub, file_id_of
from manifest_helpers import dir_entry, file_entry, write_manifest

from cachefs.cache import BlockCache, BlockKey
from cachefs.config import MemoryBudget, MountConfig, memory_budget, parse_hub_url
from cachefs.db import open_index_db, open_namespace_db
from cachefs.fetch.fetcher import Fetcher
from cachefs.metrics import Stats
from cachefs.namespace.tree import Inode, Namespace, load_manifest
from cachefs.prefetch.readahead import ReadAhead
from cachefs.read.blocks import BlockSource
from cachefs.read.claims import ReadAheadClaims
from cachefs.read.handles import OpenFile
from cachefs.read.held import HeldBlocks
from cachefs.read.reader import Reader
from cachefs.training.advice import ActivePlans
from cachefs.training.planner import Planner

KiB = 1024
BLOCK = 64 * KiB
VERSION = (1).to_bytes(8, "big")  # of every file (manifest_helpers.file_entry's default)


def budget_of(block_size: int = BLOCK, **shares: object) -> MemoryBudget:
    """The memory budget of a mount with `block_size` blocks, with shares replaced as given."""
    config = MountConfig(hub_url=parse_hub_url("http://127.0.0.1:8470"), mountpoint=Path("/mnt/c"),
                         cache_dir=Path("/var/cache/c"), block_size_bytes=block_size)
    return dataclasses.replace(memory_budget(config), **shares)  # type: ignore[arg-type]


def manifest_entries(files: dict[str, bytes]) -> Iterator[dict[str, object]]:
    """The hub's manifest entries of `files` (path -> bytes), directories before their contents."""
    yield dir_entry("")
    directories: set[str] = set()
    for path in sorted(files):
        parts = path.split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            if directory not in directories:
                directories.add(directory)
                yield dir_entry(directory)
        yield file_entry(path, len(files[path]))


@contextlib.contextmanager
def loaded_namespace(directory: Path, files: dict[str, bytes]) -> Iterator[Namespace]:
    """A namespace of `files` in LMDB, loaded from a manifest as the spoke loads the hub's."""
    manifest = write_manifest(directory / "manifest.ndjson.gz", "g1", manifest_entries(files))
    db = open_namespace_db(directory / "namespace.lmdb")
    try:
        load_manifest(db, manifest)
        yield Namespace(db)
    finally:
        db.close()


class NoPlans:
    """No loader's plan: read-ahead guesses on its own."""

    def covers(self, inode: Inode) -> bool:
        return False

    def observe(self, key: BlockKey) -> None:
        pass


@dataclasses.dataclass
class Spoke:
    """The components of one mount's read path, built as daemon.py builds them."""

    hub: FakeHub
    files: dict[str, bytes]
    namespace: Namespace
    cache: BlockCache
    held: HeldBlocks
    stats: Stats
    fetcher: Fetcher
    source: BlockSource
    reader: Reader
    planner: Planner | None
    block_size: int
    nursery: trio.Nursery
    filled: list[Inode]  # the files background fills went through, in order

    def inode(self, path: str) -> Inode:
        inode = self.namespace.resolve(path)
        assert inode is not None, path
        return inode

    def key(self, path: str, blockno: int) -> BlockKey:
        return BlockKey(file_id_of(path), VERSION, blockno)

    def open(self, path: str, pid: int = 1) -> OpenFile:
        return self.reader.open(self.inode(path), pid, passthrough=False)

    async def read(self, handle: OpenFile, offset: int, size: int) -> bytes:
        return bytes(await self.reader.read(handle, offset, size))

    def block(self, path: str, blockno: int) -> bytes:
        """What the hub holds of the block."""
        return self.files[path][blockno * self.block_size : (blockno + 1) * self.block_size]

    async def written(self) -> None:
        """Until every block fetched so far is through the cache writer. Waited for in a loop:
        the writer works in a thread, and while it does the mock clock jumps to the next
        deadline (`Fetcher.written`'s timeout among them)."""
        keys = {self.key(path, blockno) for path, data in self.files.items()
                for blockno in range(-(-len(data) // self.block_size))}
        while any(self.fetcher.flight(key) is not None for key in keys):
            await self.fetcher.written(keys)

    def blocks_asked(self, path: str) -> list[int]:
        return self.hub.blocks_asked(file_id_of(path), self.block_size)


@contextlib.asynccontextmanager
async def running_spoke(
    directory: Path,
    files: dict[str, bytes],
    *,
    hub: FakeHub | None = None,
    block_size: int = BLOCK,
    budget: MemoryBudget | None = None,
    cache_bytes: int = 1 << 30,
    fetch_timeout_s: float = 10.0,
    prefetch_connections: int = 4,
    readahead_blocks: int = 64,
    sibling_prefetch_files: int = 0,
    planner: bool = False,
    coverage: NoPlans | None = None,
    writer: bool = True,
) -> AsyncIterator[Spoke]:
    """The read path over a fake hub serving `files` (path -> bytes), its background tasks
    running until the block ends; with `planner`, a Planner follows loaders' plans (else
    `coverage` says which files a plan covers: none by default)."""
    budget = budget or budget_of(block_size)
    hub = hub or FakeHub()
    hub.files.update({(file_id_of(path).hex(), VERSION.hex()): data for path, data in files.items()})
    stats = Stats()
    with loaded_namespace(directory, files) as namespace:
        index_db = open_index_db(directory / "index.lmdb")
        try:
            held = HeldBlocks(budget)
            claims = ReadAheadClaims()
            plans = ActivePlans(held)
            cache = BlockCache(index_db, directory, cache_bytes, block_size, stats, advisor=plans)
            fetcher = Fetcher(hub, cache, held, claims, stats, budget=budget, fetch_timeout_s=fetch_timeout_s,
                              prefetch_connections=prefetch_connections)
            async with trio.open_nursery() as nursery:
                if writer:  # else the test starts it (fetched blocks stay on their way to the cache until then)
                    await nursery.start(fetcher.run_writer)
                follower = None
                if planner:
                    follower = Planner(namespace, cache, fetcher, held, plans, stats, budget=budget,
                                       cache_dir=directory)
                    await nursery.start(follower.run)
                filled: list[Inode] = []  # the files background fills went through
                readahead = ReadAhead(namespace, cache, fetcher, plans if planner else coverage or NoPlans(),
                                      stats, block_size=block_size, readahead_blocks=readahead_blocks,
                                      sibling_prefetch_files=sibling_prefetch_files, nursery=nursery,
                                      on_filled=filled.append)
                source = BlockSource(held, cache, fetcher, stats)
                reader = Reader(source, cache.sketch, claims, follower or NoPlans(), readahead, stats,
                                block_size=block_size)
                yield Spoke(hub, files, namespace, cache, held, stats, fetcher, source, reader, follower,
                            block_size, nursery, filled)
                nursery.cancel_scope.cancel()
        finally:
            index_db.close()
