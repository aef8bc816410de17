"""Byte buffers that a read fills whole, allocated without zeroing them first."""

from __future__ import annotations

import ctypes

# The C API's constructor with no source leaves the bytes as malloc gave them;
# `bytearray(n)` zeroes them first, a visible share of the daemon's CPU
# (docs/performance.md) spent on bytes the read then overwrites.
_from_string_and_size = ctypes.pythonapi.PyByteArray_FromStringAndSize
_from_string_and_size.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_from_string_and_size.restype = ctypes.py_object


def unfilled_buffer(size: int) -> bytearray:
    """A bytearray of `size` bytes whose contents are undefined: hand it on only once a read has filled all of it."""
    buffer: bytearray = _from_string_and_size(None, size)
    return buffer
