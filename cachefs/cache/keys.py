"""BlockKey: which bytes a cached block holds."""

from __future__ import annotations

import struct
from typing import NamedTuple

_KEY = struct.Struct(">8s8sI")

# A block's bytes: filled in place when read from disk or received from the
# hub, never modified afterwards; a memoryview when the buffer is a slot of
# the block buffer pool (buffers.py).
BlockData = bytes | bytearray | memoryview


class BlockKey(NamedTuple):
    """Block `blockno` of one version of one hub file.

    The version is part of the key, so a block of an old version can never be
    served for a new one. A named tuple, not a dataclass: keys are made,
    hashed and compared in every dict of the read path, and a tuple's hash
    and equality run in C (a frozen dataclass's are Python functions, four
    to five times slower).
    """

    file_id: bytes  # 8 bytes, the hub's file id
    version: bytes  # 8 bytes, the hub's content version
    blockno: int

    def packed(self) -> bytes:
        return _KEY.pack(self.file_id, self.version, self.blockno)

    @classmethod
    def unpack(cls, data: bytes) -> BlockKey:
        file_id, version, blockno = _KEY.unpack(data)
        return cls(file_id, version, blockno)

    def file_name(self) -> str:
        return f"{self.file_id.hex()}-{self.version.hex()}-{self.blockno}"

    def __str__(self) -> str:
        return f"file {self.file_id.hex()} block {self.blockno}"
