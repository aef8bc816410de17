"""A real NFS client in user space (libnfs through ctypes) that holds its file handles.

Run as a subprocess (in the NFS server's network namespace) that answers one
JSON command per line, so a test can open a file, leave the client idle while
the server restarts, and read again through the same handle:

    {"op": "open", "path": "/shards/a.bin"}      -> {"ok": true, "id": 1}
    {"op": "read", "id": 1, "offset": 0, "size": 4096} -> {"ok": true, "data": HEX}
    {"op": "stat", "path": "/x"}                  -> {"ok": true, "size": N}
    {"op": "fstat", "id": 1}                      -> {"ok": true, "size": N} (GETATTR of the handle)
    {"op": "sha256", "path": "/x"}                -> {"ok": true, "sha256": HEX, "size": N}

Errors come back as {"ok": false, "errno": N, "error": TEXT}.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from typing import Any

# libnfs 4.0 (Debian 12's libnfs13): pread takes (offset, count, buf); libnfs 6 changed the order.
LIBNFS_SONAME = "libnfs.so.13"


class NfsStat64(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "dev", "ino", "mode", "nlink", "uid", "gid", "rdev", "size", "blksize", "blocks",
            "atime", "mtime", "ctime", "atime_nsec", "mtime_nsec", "ctime_nsec", "used",
        )
    ]


class NfsClient:
    """One mounted NFS export (NFSv3 or v4) and the files opened on it."""

    def __init__(self, server: str, export: str, version: int, timeout_ms: int = 10_000) -> None:
        lib = ctypes.CDLL(LIBNFS_SONAME)
        lib.nfs_init_context.restype = ctypes.c_void_p
        lib.nfs_get_error.restype = ctypes.c_char_p
        lib.nfs_get_error.argtypes = [ctypes.c_void_p]
        lib.nfs_set_version.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.nfs_set_timeout.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.nfs_mount.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        lib.nfs_open.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
        lib.nfs_pread.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p]
        lib.nfs_stat64.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(NfsStat64)]
        lib.nfs_fstat64.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(NfsStat64)]
        self._lib = lib
        self._nfs = lib.nfs_init_context()
        lib.nfs_set_version(self._nfs, version)
        lib.nfs_set_timeout(self._nfs, timeout_ms)
        self._files: dict[int, ctypes.c_void_p] = {}
        self._check(lib.nfs_mount(self._nfs, server.encode(), export.encode()))

    def _check(self, result: int) -> int:
        if result < 0:
            raise OSError(-result, (self._lib.nfs_get_error(self._nfs) or b"").decode(errors="replace"))
        return result

    def open(self, path: str) -> int:
        handle = ctypes.c_void_p()
        self._check(self._lib.nfs_open(self._nfs, path.encode("utf-8", "surrogateescape"), 0, ctypes.byref(handle)))
        self._files[len(self._files) + 1] = handle
        return len(self._files)

    def read(self, file: int, offset: int, size: int) -> bytes:
        buffer = ctypes.create_string_buffer(size)
        count = self._check(self._lib.nfs_pread(self._nfs, self._files[file], offset, size, buffer))
        return buffer.raw[:count]

    def sha256(self, path: str) -> tuple[str, int]:
        """Digest and length of a whole file, read in 1 MiB requests through a new handle."""
        file = self.open(path)
        digest, offset = hashlib.sha256(), 0
        while chunk := self.read(file, offset, 1 << 20):
            digest.update(chunk)
            offset += len(chunk)
        return digest.hexdigest(), offset

    def fstat(self, file: int) -> NfsStat64:
        result = NfsStat64()
        self._check(self._lib.nfs_fstat64(self._nfs, self._files[file], ctypes.byref(result)))
        return result

    def stat(self, path: str) -> NfsStat64:
        result = NfsStat64()
        self._check(self._lib.nfs_stat64(self._nfs, path.encode("utf-8", "surrogateescape"), ctypes.byref(result)))
        return result


def _serve(client: NfsClient) -> None:
    for line in sys.stdin:
        command = json.loads(line)
        answer: dict[str, Any]
        try:
            if command["op"] == "open":
                answer = {"ok": True, "id": client.open(command["path"])}
            elif command["op"] == "read":
                answer = {"ok": True, "data": client.read(command["id"], command["offset"], command["size"]).hex()}
            elif command["op"] == "sha256":
                digest, size = client.sha256(command["path"])
                answer = {"ok": True, "sha256": digest, "size": size}
            elif command["op"] == "fstat":
                answer = {"ok": True, "size": client.fstat(command["id"]).size}
            else:
                answer = {"ok": True, "size": client.stat(command["path"]).size}
        except OSError as exc:
            answer = {"ok": False, "errno": exc.errno, "error": exc.strerror}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    try:
        nfs = NfsClient(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    except OSError as exc:
        print(json.dumps({"ok": False, "errno": exc.errno, "error": exc.strerror}), flush=True)
        sys.exit(1)
    print(json.dumps({"ok": True}), flush=True)
    _serve(nfs)
