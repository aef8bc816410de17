"""Dropping the cached blocks of file versions a new snapshot no longer has (real LMDB and data
files in a temp dir): a batch at a time, and a drop cut short leaves the rest whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from cache_helpers import block_cache
from manifest_helpers import dir_entry, file_entry, write_manifest

from cachefs.cache import BlockCache, BlockKey
from cachefs.config import MountConfig, parse_hub_url
from cachefs.db import open_namespace_db
from cachefs.fetch.hub_client import HubClient
from cachefs.namespace import snapshots
from cachefs.namespace.tree import Namespace, inode_number, load_manifest

BLOCK = 64 * 1024
FILES = 100


def cached_versions(cache: BlockCache) -> set[tuple[bytes, bytes]]:
    return {(key.file_id, key.version) for key in cache.index.iter_keys()}


def data_files(tmp_path: Path) -> int:
    return sum(1 for path in (tmp_path / "data").rglob("*") if path.is_file())


def test_stale_versions_are_dropped_a_batch_at_a_time_and_a_cut_drop_leaves_the_rest_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [f"f{n:03d}" for n in range(FILES)]
    namespace_db = open_namespace_db(tmp_path / "namespace.lmdb")
    try:
        load_manifest(namespace_db, write_manifest(tmp_path / "m.gz", "g2", [dir_entry("")] + [
            file_entry(path, 2 * BLOCK, version=2) for path in paths]))
        config = MountConfig(hub_url=parse_hub_url("http://127.0.0.1:9"), mountpoint=tmp_path, cache_dir=tmp_path)
        namespace = Namespace(namespace_db)
        with block_cache(tmp_path, 1 << 30, BLOCK) as cache:
            stale = [BlockKey(inode_number(path).to_bytes(8, "big"), (1).to_bytes(8, "big"), n)
                     for path in paths for n in range(2)]  # version 1 of every file: stale in g2
            assert cache.insert_many([(key, bytes(BLOCK), True) for key in stale]) == len(stale)
            assert data_files(tmp_path) == FILES
            monkeypatch.setattr(snapshots, "DROP_BATCH_VERSIONS", 10)
            batches: list[int] = []
            drop_versions = cache.drop_versions

            def counted(versions: list[list[BlockKey]]) -> None:
                drop_versions(versions)
                batches.append(len(versions))
                if len(batches) == 3:
                    trio.from_thread.run_sync(scope.cancel)  # an unmount, say

            monkeypatch.setattr(cache, "drop_versions", counted)
            spoke = snapshots.Snapshots(config, HubClient(config.hub_url, max_connections=1, connect_timeout_s=1,
                                                          read_timeout_s=1), namespace_db, namespace)

            async def drop() -> int | None:
                nonlocal scope
                with trio.CancelScope() as scope:
                    return await spoke._drop_stale(cache, "g2")
                return None

            scope = trio.CancelScope()
            assert trio.run(drop) is None
            assert batches == [10, 10, 10]
            assert len(cached_versions(cache)) == FILES - 30 and data_files(tmp_path) == FILES - 30
            assert cache.stale_checked_for() is None  # the next mount drops the rest
            assert trio.run(spoke._drop_stale, cache, "g2") == 2 * (FILES - 30)
            assert batches == [10] * 10
            assert cached_versions(cache) == set() and data_files(tmp_path) == 0
            assert cache.stale_checked_for() == "g2"
    finally:
        namespace_db.close()
