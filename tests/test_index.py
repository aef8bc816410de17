"""The block index on a real LMDB in a temp dir: paging in one file version's entries."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_helpers import block_cache

from cachefs.cache import BlockCache, BlockKey

BLOCK = 4096
FILE_ID, NEXT_FILE_ID = b"\x01" * 8, b"\x01" * 7 + b"\x02"
VERSION, OTHER_VERSION = b"\x02" * 8, b"\x03" * 8


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[BlockCache]:
    with block_cache(tmp_path, 64 * BLOCK, BLOCK) as opened:
        yield opened


def test_page_in_reads_exactly_the_entries_of_one_file_version(cache: BlockCache) -> None:
    blocks = [(FILE_ID, VERSION, 10), (FILE_ID, OTHER_VERSION, 5), (NEXT_FILE_ID, VERSION, 3)]
    for file_id, version, count in blocks:
        inserted = cache.insert_many([(BlockKey(file_id, version, n), bytes([n]) * BLOCK, True) for n in range(count)])
        assert inserted == count
    assert cache.index.page_in(FILE_ID, VERSION) == 10
    assert cache.index.page_in(FILE_ID, OTHER_VERSION) == 5
    assert cache.index.page_in(NEXT_FILE_ID, VERSION) == 3
    assert cache.index.page_in(b"\x09" * 8, VERSION) == 0
    cache.page_in_index(FILE_ID, VERSION)  # the best-effort form the read-ahead calls: no error
