"""Block data on local disk: one file per block under blocks/<2 hex>/.

A block is written to tmp/ and renamed into place, so a block file is
either complete or absent; the index entry is committed only after that.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from .keys import BlockData, BlockKey

log = logging.getLogger(__name__)


class BlockStore:
    """Read, write and delete block files."""

    def __init__(self, cache_dir: Path) -> None:
        self.blocks_dir = cache_dir / "blocks"
        self.tmp_dir = cache_dir / "tmp"
        self.blocks_dir.mkdir(mode=0o700, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # leftovers of a crash mid-write
        self.tmp_dir.mkdir(mode=0o700)

    def path(self, key: BlockKey) -> Path:
        return self.blocks_dir / key.file_id.hex()[:2] / key.file_name()

    def read(self, key: BlockKey, length: int) -> bytes | None:
        """The block's bytes, or None if the file is missing or short."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, length, 0)
        finally:
            os.close(fd)
        return data if len(data) == length else None

    def write(self, key: BlockKey, data: BlockData) -> None:
        """Write a complete block file (raises OSError, e.g. ENOSPC)."""
        final = self.path(key)
        tmp = self.tmp_dir / f"{key.file_name()}.{os.getpid()}.{id(data):x}"
        try:
            with open(tmp, "wb", opener=_private_opener) as out:
                out.write(data)
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                final.parent.mkdir(mode=0o700, exist_ok=True)
                os.rename(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def delete(self, key: BlockKey) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)
