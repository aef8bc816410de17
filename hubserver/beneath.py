"""Opening a path inside a directory without following a symlink in any of its components.

`O_NOFOLLOW` guards only the last component of a path: a directory of the
root swapped for a symlink to the outside would still be followed, and the
open itself has side effects on what it reaches (a FIFO's blocked writer
goes on, a device is opened). Where the kernel has it (Linux 5.6+),
`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` refuses such a
path in one call; elsewhere the path is walked one directory at a time,
each opened with `O_NOFOLLOW` relative to the one before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from typing import Final

# openat2 has the same number on every architecture that uses the common syscall table.
_SYS_OPENAT2: Final = 437
_OPENAT2_MACHINES: Final = frozenset({"x86_64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x"})
_RESOLVE_NO_SYMLINKS: Final = 0x04
_RESOLVE_BENEATH: Final = 0x08
# Walking: every directory is opened, never followed.
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# The errors that mean openat2 cannot be used here (no such system call, or a seccomp
# filter that refuses it), not that the path is bad.
_OPENAT2_MISSING: Final = frozenset({errno.ENOSYS, errno.EPERM, errno.E2BIG})


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _Openat2:
    """The openat2 system call through libc's syscall(), if this system has it."""

    def __init__(self) -> None:
        self._syscall = None
        if os.uname().sysname == "Linux" and platform.machine() in _OPENAT2_MACHINES:
            libc = ctypes.CDLL(None, use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._syscall is not None

    def open(self, dir_fd: int, rel_path: bytes, flags: int) -> int:
        """openat2(dir_fd, rel_path, flags, BENEATH | NO_SYMLINKS); raises OSError.
        NotImplementedError (and never again tried) if the kernel refuses the call itself."""
        syscall = self._syscall
        if syscall is None:
            raise NotImplementedError
        how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        fd = syscall(
            ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(rel_path),
            ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        code = ctypes.get_errno()
        if code in _OPENAT2_MISSING and not self._works(dir_fd):
            with self._lock:
                self._syscall = None
            raise NotImplementedError
        raise OSError(code, os.strerror(code))

    def _works(self, dir_fd: int) -> bool:
        """Whether openat2 opens the directory itself: tells a missing (or filtered) system
        call from an error about one path."""
        how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        fd = self._syscall(  # type: ignore[misc]
            ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(b"."),
            ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd < 0:
            return False
        os.close(fd)
        return True


_OPENAT2 = _Openat2()


def open_beneath(root: bytes, rel_path: bytes, flags: int) -> int:
    """Open `rel_path` ('/'-separated, no '..' or empty components) inside the directory
    `root` with `flags`, following no symlink on the way (ELOOP if a component is one,
    ENOTDIR if one is not a directory). Raises OSError. Blocking."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _OPENAT2.available:
            try:
                return _OPENAT2.open(root_fd, rel_path, flags)
            except NotImplementedError:
                pass
        return open_walking(root_fd, rel_path, flags)
    finally:
        os.close(root_fd)


def open_walking(root_fd: int, rel_path: bytes, flags: int) -> int:
    """open_beneath without openat2, relative to an open directory: one directory at a
    time, each with O_NOFOLLOW. Raises OSError."""
    *directories, name = rel_path.split(b"/")
    dir_fd = root_fd
    try:
        for directory in directories:
            next_fd = os.open(directory, _DIR_FLAGS, dir_fd=dir_fd)
            if dir_fd != root_fd:
                os.close(dir_fd)
            dir_fd = next_fd
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    finally:
        if dir_fd != root_fd:
            os.close(dir_fd)
