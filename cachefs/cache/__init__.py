"""The local block cache: index in LMDB, block data in files, eviction under a size limit."""

from .block_cache import BlockCache
from .keys import BlockData, BlockKey

__all__ = ["BlockCache", "BlockData", "BlockKey"]
