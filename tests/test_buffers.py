"""Buffers allocated without zeroing: right size, writable, filled by a read."""

import os
from pathlib import Path

from cachefs.buffers import unfilled_buffer


def test_an_unfilled_buffer_has_its_size_and_takes_a_read(tmp_path: Path) -> None:
    source = os.urandom(1 << 20)
    path = tmp_path / "data"
    path.write_bytes(source)
    buffer = unfilled_buffer(len(source))
    assert isinstance(buffer, bytearray) and len(buffer) == len(source)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [buffer], 0) == len(source)
    finally:
        os.close(fd)
    assert buffer == source
    assert len(unfilled_buffer(0)) == 0
