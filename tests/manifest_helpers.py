"""Manifests as the hub writes them (gzipped NDJSON, header first), for tests that load a namespace without a hub."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from pathlib import Path

import xxhash

HEADER = {"format": "cachefs-manifest", "format_version": 1}


def file_entry(path: str, size: int, version: int = 1) -> dict[str, object]:
    file_id = xxhash.xxh3_64_intdigest(os.fsencode(path)).to_bytes(8, "big")
    return {"p": path, "k": "f", "m": 0o644, "t": 0, "s": size, "i": file_id.hex(), "v": version.to_bytes(8, "big").hex()}


def dir_entry(path: str) -> dict[str, object]:
    return {"p": path, "k": "d", "m": 0o755, "t": 0}


def write_manifest(path: Path, generation: str, entries: Iterable[dict[str, object]]) -> Path:
    with gzip.open(path, "wt", compresslevel=1) as stream:
        stream.write(json.dumps({**HEADER, "generation": generation}) + "\n")
        for entry in entries:
            stream.write(json.dumps(entry) + "\n")
    return path
