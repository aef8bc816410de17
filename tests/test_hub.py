"""The hub through its real interface: a `python -m hubserver` subprocess on
loopback, spoken to with the standard library's HTTP client."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import gzip
import http.client
import json
import os
import random
import signal
import socket
import stat
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash
from aiohttp.test_utils import TestServer
from hub_helpers import HubProcess, Manifest, fetch_manifest, run_hub_cli, running_hub
from hub_helpers import http_get as get

from cachefs.db import open_namespace_db
from cachefs.namespace.tree import load_manifest
from hubserver.app import make_app
from hubserver.config import HubConfig
from hubserver.files import check_unchanged
from hubserver.manifest import ManifestWriter, header_line
from hubserver.rescan import SNAPSHOT_KEY
from hubserver.scan import scan
from hubserver.snapshot import Snapshot

pytestmark = pytest.mark.timeout(60)

BIG_SIZE = 1024 * 1024 + 123
NON_UTF8_NAME = b"x-\xff\xfe.bin"
UNICODE_NAME = "ünïcødé-名前.txt"
OUTSIDE_FILE = "/etc/passwd"
OUTSIDE_DIR = "/etc"
IMMUTABLE = "public, max-age=31536000, immutable"

# The manifest order the protocol prescribes for the tree of `build_tree`:
# depth-first, names sorted by bytes, directories before their children.
EXPECTED_ORDER = [
    "",
    "big.bin",
    "dirlink_outside",
    "empty.bin",
    "emptydir",
    "link_inside",
    "link_outside",
    "name with spaces.txt",
    "nested",
    "nested/deeper",
    "nested/deeper/leaf.bin",
    "nested/z.txt",
    "one.bin",
    "small.txt",
    os.fsdecode(NON_UTF8_NAME),
    UNICODE_NAME,
]


# --------------------------------------------------------------- client side


def path_bytes(rel: str) -> bytes:
    return rel.encode("utf-8", "surrogateescape")


def file_url(entry: Mapping[str, object], version: bool = True) -> str:
    url = f"/v1/files/{entry['i']}"
    return f"{url}?v={entry['v']}" if version else url


# --------------------------------------------------------------- the test tree


@dataclass
class Tree:
    root: Path
    contents: dict[str, bytes]  # relative path -> bytes, every regular file


def build_tree(root: Path) -> dict[str, bytes]:
    """Create the test tree; return the content of each regular file."""
    rng = random.Random(1234)
    contents = {
        "big.bin": rng.randbytes(BIG_SIZE),
        "empty.bin": b"",
        "one.bin": b"\x01",
        "small.txt": b"hello world\n",
        "name with spaces.txt": b"spaces are fine\n",
        UNICODE_NAME: "unicode content ✓\n".encode(),
        os.fsdecode(NON_UTF8_NAME): b"latin-1 named file\n",
        "nested/deeper/leaf.bin": rng.randbytes(5000),
        "nested/z.txt": b"zzz\n",
    }
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "emptydir").mkdir()
    for rel, data in contents.items():
        (root / rel).write_bytes(data)
    os.chmod(root / "small.txt", 0o640)
    os.chmod(root / "one.bin", 0o755)
    os.symlink("small.txt", root / "link_inside")
    os.symlink(OUTSIDE_FILE, root / "link_outside")
    os.symlink(OUTSIDE_DIR, root / "dirlink_outside")
    os.mkfifo(root / "fifo")
    return contents


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    root = tmp_path_factory.mktemp("tree")
    return Tree(root, build_tree(root))


@pytest.fixture(scope="module")
def tree_hub(tree: Tree) -> Iterator[HubProcess]:
    with running_hub(tree.root) as process:
        yield process


@pytest.fixture(scope="module")
def manifest(tree_hub: HubProcess) -> Manifest:
    return fetch_manifest(tree_hub)


@pytest.fixture()
def big(manifest: Manifest, tree: Tree) -> tuple[dict[str, Any], bytes]:
    return manifest.by_path()["big.bin"], tree.contents["big.bin"]


# --------------------------------------------------------------- health, manifest


def test_healthz_reports_the_snapshot(tree_hub: HubProcess, tree: Tree, manifest: Manifest) -> None:
    reply = get(tree_hub, "/healthz")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("application/json")
    contents = tree.contents
    assert reply.json() == {
        "status": "ok",
        "generation": manifest.header["generation"],
        "files": len(contents),
        "bytes": sum(len(data) for data in contents.values()),
    }


def test_scan_is_logged_with_counts(tree_hub: HubProcess, tree: Tree, manifest: Manifest) -> None:
    contents = tree.contents
    log = tree_hub.stderr_text()
    total = sum(len(data) for data in contents.values())
    assert f"{len(contents)} files, {total} bytes" in log
    assert str(manifest.header["generation"]) in log


def test_manifest_is_streamed_gzip_ndjson(manifest: Manifest) -> None:
    headers = manifest.reply.headers
    assert headers["content-type"] == "application/x-ndjson"
    assert headers["content-encoding"] == "gzip"
    assert headers["transfer-encoding"] == "chunked"
    assert "content-length" not in headers
    assert manifest.reply.body[:2] == b"\x1f\x8b"  # compressed once, by us


def test_manifest_header(manifest: Manifest) -> None:
    header = manifest.header
    assert header["format"] == "cachefs-manifest"
    assert header["format_version"] == 1
    assert header["entries"] == len(manifest.entries) == len(EXPECTED_ORDER)
    assert header["generation"] == xxhash.xxh3_64_hexdigest(b"".join(manifest.entry_lines))


def test_manifest_lists_the_tree_in_protocol_order(manifest: Manifest) -> None:
    assert [e["p"] for e in manifest.entries] == EXPECTED_ORDER
    assert "fifo" not in manifest.by_path()


def test_manifest_entries_match_the_disk(manifest: Manifest, tree: Tree) -> None:
    root = tree.root
    for entry in manifest.entries:
        rel = str(entry["p"])
        st = os.lstat(os.path.join(os.fsencode(root), path_bytes(rel)) if rel else root)
        assert entry["m"] == stat.S_IMODE(st.st_mode), rel
        assert entry["t"] == st.st_mtime_ns, rel
        assert entry["s"] == st.st_size, rel
        if stat.S_ISDIR(st.st_mode):
            assert entry["k"] == "d" and set(entry) == {"p", "k", "m", "t", "s"}, rel
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(os.path.join(os.fsencode(root), path_bytes(rel)))
            assert entry["k"] == "l" and entry["l"] == os.fsdecode(target), rel
            assert "i" not in entry and "v" not in entry, rel
        else:
            assert entry["k"] == "f", rel
            assert entry["i"] == xxhash.xxh3_64_hexdigest(path_bytes(rel)), rel
            key = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
            assert entry["v"] == xxhash.xxh3_64_hexdigest(key.encode()), rel


def test_manifest_names_roundtrip_to_original_bytes(manifest: Manifest, tree: Tree) -> None:
    root = tree.root
    names = {path_bytes(str(e["p"])) for e in manifest.entries if "/" not in str(e["p"])}
    on_disk = set(os.listdir(os.fsencode(root))) - {b"fifo"}
    assert names - {b""} == on_disk
    assert NON_UTF8_NAME in names and UNICODE_NAME.encode() in names


def test_symlinks_are_listed_not_followed(manifest: Manifest) -> None:
    entries = manifest.by_path()
    assert entries["link_inside"]["l"] == "small.txt"
    assert entries["link_outside"]["l"] == OUTSIDE_FILE
    assert entries["link_outside"]["s"] == len(OUTSIDE_FILE)
    assert entries["dirlink_outside"]["k"] == "l"
    assert not any(str(p).startswith("dirlink_outside/") for p in entries)


@pytest.mark.parametrize("count", [0, 1, 60000])
def test_the_manifest_is_one_gzip_member_with_the_header_first(count: int) -> None:
    """The entries are compressed as the scan finds them and the header (known at the end) is
    put in front: a single gzip member whose CRC and length check out, as a spoke reads it."""
    lines = [
        json.dumps({"p": f"dir/{n:07d}", "v": xxhash.xxh3_64_hexdigest(str(n).encode())}).encode() + b"\n"
        for n in range(count)
    ]
    writer = ManifestWriter()
    for line in lines:
        writer.add(line)
    gzipped = writer.finish()
    inflater = zlib.decompressobj(wbits=31)
    text = inflater.decompress(gzipped)
    assert inflater.eof and not inflater.unused_data
    generation = xxhash.xxh3_64_hexdigest(b"".join(lines))
    assert text == gzip.decompress(gzipped) == header_line(generation, count) + b"".join(lines)
    assert json.loads(text.split(b"\n")[0])["entries"] == writer.entry_count == count


def test_a_snapshot_holds_its_entries_compactly(tmp_path: Path) -> None:
    """The scan keeps the manifest gzipped and each file packed in one bytes object
    (before: ~600 bytes an entry as objects; ~770 MB of Python heap for ImageNet's 1.28 M files)."""
    for d in range(20):
        (tmp_path / f"n{d:08d}").mkdir()
        for n in range(1000):
            (tmp_path / f"n{d:08d}" / f"n{d:08d}_{n}.JPEG").touch()
    tracemalloc.start()
    try:
        snapshot = scan(tmp_path)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert snapshot.entry_count == 20_021 and snapshot.file_count == 20_000
    assert held / snapshot.entry_count < 300, f"{held / snapshot.entry_count:.0f} bytes an entry"
    record = snapshot.files_by_id.get(xxhash.xxh3_64_hexdigest(b"n00000007/n00000007_5.JPEG"))
    assert record is not None and record.path == "n00000007/n00000007_5.JPEG" and record.size_bytes == 0
    assert snapshot.files_by_id.get("0" * 16) is None and snapshot.files_by_id.get("x_1") is None


def test_a_file_dated_after_2262_is_listed_clamped_and_served(tmp_path: Path) -> None:
    """Nanoseconds since 1970 overflow 64 bits after 2262 (ext4 dates files up to 2446): the
    manifest clamps such an mtime, so spokes accept it, and the hub keeps the exact one, so the
    file is not taken for changed (before: the scan failed with struct.error)."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "future.txt").write_bytes(b"from the future\n")
    os.utime(root / "future.txt", ns=(0, 10**19))  # 2286
    snapshot = scan(root)
    record = snapshot.files_by_id.get(xxhash.xxh3_64_hexdigest(b"future.txt"))
    assert record is not None and record.mtime_ns == os.stat(root / "future.txt").st_mtime_ns == 10**19
    assert check_unchanged(snapshot, record)
    entries = [json.loads(line) for line in gzip.decompress(snapshot.manifest_gz).splitlines()[1:]]
    assert [entry["t"] for entry in entries if entry["p"] == "future.txt"] == [(1 << 63) - 1]
    manifest = tmp_path / "manifest.gz"
    manifest.write_bytes(snapshot.manifest_gz)
    namespace_db = open_namespace_db(tmp_path / "namespace.lmdb")
    try:
        summary, _changes = load_manifest(namespace_db, manifest)  # what a spoke does with it
    finally:
        namespace_db.close()
    assert summary.entries == 2


def test_large_manifest_streams_in_many_chunks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    expected = [""]
    for d in range(40):
        directory = f"d{d:02d}"
        (root / directory).mkdir(parents=True)
        expected.append(directory)
        for n in range(100):
            name = f"{xxhash.xxh3_64_hexdigest(f'{d}/{n}'.encode())}.bin"
            (root / directory / name).write_bytes(name.encode())
        expected.extend(sorted(f"{directory}/{name}" for name in os.listdir(root / directory)))
    with running_hub(root) as hub:
        conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
        try:
            conn.request("GET", "/v1/manifest")
            response = conn.getresponse()
            pieces = []
            while piece := response.read1(1 << 20):
                pieces.append(piece)
        finally:
            conn.close()
    body = b"".join(pieces)
    assert len(body) > 2 * 64 * 1024  # more than one 64 KiB chunk
    lines = gzip.decompress(body).splitlines()
    assert json.loads(lines[0])["entries"] == len(expected) == len(lines) - 1
    assert [json.loads(line)["p"] for line in lines[1:]] == expected


def test_a_slow_manifest_reader_keeps_no_replaced_snapshot_alive(tmp_path: Path) -> None:
    """A client reading the manifest slowly through a rescan holds the bytes of the manifest
    it was being sent, not the old snapshot and its table of files (one per slow reader)."""
    root = tmp_path / "root"
    for d in range(20):
        (root / f"d{d:02d}").mkdir(parents=True)
        for n in range(500):
            (root / f"d{d:02d}" / f"{xxhash.xxh3_64_hexdigest(f'{d}/{n}'.encode())}.bin").write_bytes(b"x")

    async def scenario() -> None:
        app = make_app(HubConfig(root=root, access_log=False))
        async with TestServer(app) as server:
            holder = app[SNAPSHOT_KEY]
            assert len(holder.current.manifest_gz) > 256 << 10  # more than the socket buffers below take
            with socket.socket() as slow:
                slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                slow.connect(("127.0.0.1", server.port))
                await asyncio.sleep(0.1)
                [connection] = server.runner.server.connections  # type: ignore[union-attr]
                connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                slow.sendall(b"GET /v1/manifest HTTP/1.1\r\nHost: hub\r\n\r\n")  # and reads nothing
                await asyncio.sleep(0.5)  # the handler waits for the client to read
                old = id(holder.current)  # (slots: no weak reference to it)
                await holder.rescan()
                gc.collect()
                # Other tests of this process may have left snapshots of their own: this one's old is gone.
                assert all(id(thing) != old for thing in gc.get_objects() if type(thing) is Snapshot)
                assert slow.recv(64).startswith(b"HTTP/1.1 200 ")

    asyncio.run(scenario())


# --------------------------------------------------------------- file data


def test_every_served_file_is_the_file_at_its_path(tree_hub: HubProcess, manifest, tree: Tree) -> None:
    contents = tree.contents
    files = [e for e in manifest.entries if e["k"] == "f"]
    assert {e["p"] for e in files} == set(contents)
    for entry in files:
        reply = get(tree_hub, file_url(entry))
        assert reply.status == 200, entry["p"]
        assert reply.body == contents[str(entry["p"])], entry["p"]
        assert reply.headers["etag"] == f'"{entry["i"]}-{entry["v"]}"'
        assert reply.headers["cache-control"] == IMMUTABLE
        assert reply.headers["accept-ranges"] == "bytes"
        assert int(reply.headers["content-length"]) == len(contents[str(entry["p"])])
        # Without the version, the URL's content changes with the file: no cache may keep it.
        unversioned = get(tree_hub, file_url(entry, version=False))
        assert unversioned.body == reply.body and unversioned.headers["cache-control"] == "no-store"


def test_whole_file_without_version(tree_hub: HubProcess, big) -> None:
    entry, data = big
    reply = get(tree_hub, file_url(entry, version=False))
    assert reply.status == 200
    assert reply.body == data
    assert "content-range" not in reply.headers


@pytest.mark.parametrize(
    ("header", "first", "last"),
    [
        ("bytes=0-0", 0, 0),
        ("bytes=100-4195", 100, 4195),
        ("bytes=1000-", 1000, BIG_SIZE - 1),
        ("bytes=-500", BIG_SIZE - 500, BIG_SIZE - 1),
        (f"bytes={BIG_SIZE - 1}-{BIG_SIZE - 1}", BIG_SIZE - 1, BIG_SIZE - 1),
        (f"bytes={BIG_SIZE - 10}-{BIG_SIZE + 1000}", BIG_SIZE - 10, BIG_SIZE - 1),
        (f"bytes=-{BIG_SIZE + 10}", 0, BIG_SIZE - 1),
        ("bytes=65536-196607", 65536, 196607),
    ],
)
def test_range_gives_206_with_exact_bytes(tree_hub: HubProcess, big, header, first, last) -> None:
    entry, data = big
    reply = get(tree_hub, file_url(entry), {"Range": header})
    assert reply.status == 206, reply.body[:200]
    assert reply.body == data[first : last + 1]
    assert reply.headers["content-range"] == f"bytes {first}-{last}/{BIG_SIZE}"
    assert int(reply.headers["content-length"]) == last - first + 1
    assert reply.headers["etag"] == f'"{entry["i"]}-{entry["v"]}"'
    assert reply.headers["cache-control"] == IMMUTABLE


def test_conditional_headers_do_not_change_the_answer(tree_hub: HubProcess, big) -> None:
    entry, data = big
    headers = {
        "Range": "bytes=10-19",
        "If-Match": '"something-else"',
        "If-None-Match": f'"{entry["i"]}-{entry["v"]}"',
        "If-Modified-Since": "Fri, 01 Jan 2100 00:00:00 GMT",
        "Accept-Encoding": "gzip, br",
    }
    reply = get(tree_hub, file_url(entry), headers)
    assert reply.status == 206
    assert reply.body == data[10:20]
    assert "content-encoding" not in reply.headers


@pytest.mark.parametrize(
    "header",
    [
        f"bytes={BIG_SIZE}-",
        f"bytes={BIG_SIZE}-{BIG_SIZE + 5}",
        "bytes=0-1,5-6",
        "bytes=0-1, 5-6",
        "bytes=9-3",
        "bytes=abc",
        "bytes=",
        "bytes=-",
        "bytes=-0",
        "bytes=1.5-2",
        "bytes 0-10",
        "items=0-5",
        "garbage",
    ],
)
def test_unsatisfiable_range_gives_416(tree_hub: HubProcess, big, header) -> None:
    entry, _ = big
    reply = get(tree_hub, file_url(entry), {"Range": header})
    assert reply.status == 416
    assert reply.headers["content-range"] == f"bytes */{BIG_SIZE}"
    assert set(reply.json()) == {"error"}


def test_empty_file(tree_hub: HubProcess, manifest) -> None:
    entry = manifest.by_path()["empty.bin"]
    whole = get(tree_hub, file_url(entry))
    assert (whole.status, whole.body) == (200, b"")
    ranged = get(tree_hub, file_url(entry), {"Range": "bytes=0-0"})
    assert ranged.status == 416
    assert ranged.headers["content-range"] == "bytes */0"
    suffix = get(tree_hub, file_url(entry), {"Range": "bytes=-5"})
    assert suffix.status == 416


def test_unknown_id_gives_404(tree_hub: HubProcess, manifest) -> None:
    unknown = "0123456789abcdef"
    assert unknown not in {e.get("i") for e in manifest.entries}
    reply = get(tree_hub, f"/v1/files/{unknown}")
    assert reply.status == 404
    assert isinstance(reply.json()["error"], str)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/xyz",
        "/v1/files/0123456789ABCDEF",
        "/v1/files/0123456789abcde",
        "/v1/files/0123456789abcdef0",
        "/v1/files/0123456789abcdeg",
    ],
)
def test_malformed_id_gives_400(tree_hub: HubProcess, path: str) -> None:
    reply = get(tree_hub, path)
    assert reply.status == 400
    assert "error" in reply.json()


@pytest.mark.parametrize("version", ["zz", "", "0123456789ABCDEF", "0123456789abcdef00"])
def test_malformed_version_gives_400(tree_hub: HubProcess, big, version: str) -> None:
    entry, _ = big
    reply = get(tree_hub, f"/v1/files/{entry['i']}?v={version}")
    assert reply.status == 400


def test_wrong_version_gives_412(tree_hub: HubProcess, big) -> None:
    entry, _ = big
    wrong = "0" * 16 if entry["v"] != "0" * 16 else "1" * 16
    reply = get(tree_hub, f"/v1/files/{entry['i']}?v={wrong}", {"Range": "bytes=0-9"})
    assert reply.status == 412
    assert "error" in reply.json()


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files/..%2f..%2fetc%2fpasswd",
        "/v1/files/../../etc/passwd",
        "/v1/files/%2e%2e/%2e%2e/etc/passwd",
        "/v1/files/..%252f..%252fetc%252fpasswd",
        "/v1/files/%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/../../../etc/passwd",
        "/v1/manifest/../../etc/passwd",
        "/v1/files/link_outside",
        "/v1/files/dirlink_outside%2fpasswd",
    ],
)
def test_path_traversal_never_serves_outside(tree_hub: HubProcess, path: str) -> None:
    reply = get(tree_hub, path)
    assert reply.status in (400, 404), (reply.status, reply.body[:200])
    assert Path(OUTSIDE_FILE).read_bytes()[:32] not in reply.body
    assert b"root:" not in reply.body
    assert set(reply.json()) == {"error"}


def test_unknown_route_and_method_give_json_errors(tree_hub: HubProcess) -> None:
    missing = get(tree_hub, "/v2/nothing")
    assert missing.status == 404
    assert set(missing.json()) == {"error"}
    conn = http.client.HTTPConnection(tree_hub.host, tree_hub.port, timeout=10)
    try:
        conn.request("POST", "/v1/manifest", body=b"")
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    assert response.status == 405
    assert set(json.loads(body)) == {"error"}
    assert "GET" in (response.getheader("Allow") or "")


# --------------------------------------------------------------- changes on disk


def test_file_changed_on_disk_gives_412_without_rescan(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    for name in ("grown", "touched", "rewritten", "swapped", "to_symlink", "removed", "kept"):
        (root / name).write_bytes(name.encode() * 100)
    with running_hub(root) as hub:
        entries = fetch_manifest(hub).by_path()
        with open(root / "grown", "ab") as f:
            f.write(b"!")
        os.utime(root / "touched", ns=(1, 1))
        before = os.stat(root / "rewritten")  # rewritten in place, its times put back (rsync --inplace -t)
        with open(root / "rewritten", "r+b") as f:
            f.write(b"REWRITTEN" * 100)
        os.utime(root / "rewritten", ns=(before.st_atime_ns, before.st_mtime_ns))
        (root / "swapped.new").write_bytes(b"swapped" * 100)  # same size, new inode
        os.replace(root / "swapped.new", root / "swapped")
        os.symlink(OUTSIDE_FILE, root / "to_symlink.new")
        os.replace(root / "to_symlink.new", root / "to_symlink")
        (root / "removed").unlink()
        for name in ("grown", "touched", "rewritten", "swapped", "to_symlink", "removed"):
            for url in (file_url(entries[name]), file_url(entries[name], version=False)):
                reply = get(hub, url, {"Range": "bytes=0-99"})
                assert reply.status == 412, (name, reply.status, reply.body[:100])
                assert b"root:" not in reply.body
        kept = get(hub, file_url(entries["kept"]))
        assert (kept.status, kept.body) == (200, b"kept" * 100)


def test_directory_swapped_for_outside_symlink_gives_412(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_bytes(b"inside\n")
    with running_hub(root) as hub:
        entry = fetch_manifest(hub).by_path()["etc/passwd"]
        os.rename(root / "etc", tmp_path / "moved")
        os.symlink(OUTSIDE_DIR, root / "etc")
        reply = get(hub, file_url(entry))
        assert reply.status == 412
        assert b"root:" not in reply.body


def test_a_file_truncated_while_it_is_sent_ends_the_connection_at_once(tmp_path: Path) -> None:
    """The client gets a short body and a closed connection, not a wait until the idle
    timeout for bytes promised by Content-Length that will never come."""
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "big.bin", "wb") as f:
        f.truncate(64 << 20)  # sparse
    with running_hub(root, ["--idle-timeout", "30"]) as hub:
        entry = fetch_manifest(hub).by_path()["big.bin"]
        with socket.create_connection((hub.host, hub.port), timeout=20) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # the hub's send waits for us
            sock.sendall(f"GET {file_url(entry)} HTTP/1.1\r\nHost: hub\r\n\r\n".encode())
            received = sock.recv(1 << 20)
            while len(received) < (1 << 20):
                received += sock.recv(1 << 20)
            os.truncate(root / "big.bin", 0)  # same inode, now empty
            truncated = time.monotonic()
            while chunk := sock.recv(1 << 20):
                received += chunk
            closed_s = time.monotonic() - truncated
        assert closed_s < 10, closed_s
        assert len(received) < 64 << 20
        assert hub.wait_for_stderr("shrank while being sent")


def test_a_scan_never_records_a_file_outside_the_root(tmp_path: Path) -> None:
    """A directory swapped back and forth with a symlink to an outside directory while the
    tree is scanned (someone who can write in the dataset, a rescan): the scan never goes
    through the symlink, so no file outside the root is ever listed (and then served)."""
    root, outside, partner = tmp_path / "root", tmp_path / "outside", tmp_path / "partner"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    partner.mkdir()
    for number in range(2000):  # a subtree that takes a while to scan
        (root / "a" / "b" / f"f{number:04}").touch()
    (root / "a" / "secret.txt").write_bytes(b"inside")
    (outside / "secret.txt").write_bytes(b"a file outside the root")
    outside_inode = (outside / "secret.txt").stat().st_ino
    os.symlink(outside, partner / "a")
    stop = threading.Event()

    def swapper() -> None:
        while not stop.is_set():
            exchange_paths(root / "a", partner / "a")

    thread = threading.Thread(target=swapper)
    thread.start()
    try:
        recorded = [record.ino for _ in range(40) for record in scan(root).files_by_id.values()]
    finally:
        stop.set()
        thread.join()
    assert outside_inode not in recorded


def exchange_paths(first: Path, second: Path) -> None:
    """renameat2(RENAME_EXCHANGE): swap two paths atomically."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange, sys_renameat2 = -100, 2, 316  # x86_64
    if libc.syscall(sys_renameat2, at_fdcwd, bytes(first), at_fdcwd, bytes(second), rename_exchange) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def test_a_rescan_that_fails_keeps_serving_and_says_why(tmp_path: Path) -> None:
    """The root moved away: POST /v1/rescan answers 503 JSON (no traceback), SIGUSR1 logs
    the failure, and the hub keeps serving the generation it has."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "kept").write_bytes(b"kept")
    with running_hub(root) as hub:
        generation = fetch_manifest(hub).header["generation"]
        assert get(hub, "/v1/rescan?x=1&x=2", method="POST").status == 400  # it takes no query
        os.rename(root, tmp_path / "moved")
        failed = get(hub, "/v1/rescan", method="POST")
        assert failed.status == 503 and generation in failed.json()["error"]
        time.sleep(1.1)  # one rescan a second
        hub.proc.send_signal(signal.SIGUSR1)
        assert hub.wait_for_stderr("rescan of")
        assert get(hub, "/healthz").json()["generation"] == generation
    assert "Traceback" not in hub.stderr_text() and "never retrieved" not in hub.stderr_text()


def test_a_root_given_as_a_symlink_is_followed_again_at_each_rescan(tmp_path: Path) -> None:
    """The usual atomic switch of a dataset (`ln -sfn v2 current`) is published by a rescan."""
    for name in ("v1", "v2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"only-in-{name}").write_bytes(name.encode())
    (tmp_path / "current").symlink_to("v1")
    with running_hub(tmp_path / "current") as hub:
        assert "only-in-v1" in fetch_manifest(hub).by_path()
        (tmp_path / "next").symlink_to("v2")
        os.replace(tmp_path / "next", tmp_path / "current")
        assert get(hub, "/v1/rescan", method="POST").json()["rescanned"] is True
        entries = fetch_manifest(hub).by_path()
        assert "only-in-v2" in entries and "only-in-v1" not in entries
        assert get(hub, file_url(entries["only-in-v2"])).body == b"v2"


def test_generation_is_stable_across_restarts_and_changes_with_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    build_tree(root)
    generations = []
    for _ in range(2):
        with running_hub(root) as hub:
            health = get(hub, "/healthz").json()
            generations.append(fetch_manifest(hub).header["generation"])
            assert health["generation"] == generations[-1]
    assert generations[0] == generations[1]
    (root / "nested" / "new.txt").write_bytes(b"new")
    with running_hub(root) as hub:
        changed = fetch_manifest(hub).header["generation"]
    assert changed != generations[0]
    os.utime(root / "small.txt", ns=(5, 5))
    with running_hub(root) as hub:
        touched = fetch_manifest(hub).header["generation"]
    assert touched not in (changed, generations[0])


# --------------------------------------------------------------- CLI and lifecycle


def assert_one_line_error(result, needle: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cachefs-hub: error: "), lines[0]
    assert needle in lines[0], lines[0]
    assert result.stdout == ""


def test_cli_missing_root(tmp_path: Path) -> None:
    result = run_hub_cli(["serve", "--root", tmp_path / "nope", "--listen", "127.0.0.1:0"])
    assert_one_line_error(result, "does not exist")


def test_cli_root_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    result = run_hub_cli(["serve", "--root", tmp_path / "file", "--listen", "127.0.0.1:0"])
    assert_one_line_error(result, "not a directory")


def test_cli_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_hub_cli(["serve", "--root", tmp_path, "--listen", f"127.0.0.1:{port}"])
    assert_one_line_error(result, "address already in use")


def test_cli_address_not_on_this_machine(tmp_path: Path) -> None:
    # 192.0.2.0/24 is reserved for documentation: never a local address.
    # Binding fails locally; nothing is sent anywhere.
    result = run_hub_cli(["serve", "--root", tmp_path, "--listen", "192.0.2.1:0"])
    assert_one_line_error(result, "cannot listen on 192.0.2.1:0")


@pytest.mark.parametrize(
    "listen",
    ["nonsense", "127.0.0.1:", "127.0.0.1:99999", "127.0.0.1:http", ":8470", "::1:80", "127.0.0.1:-1", "127.0.0.1:80 "],
)
def test_cli_malformed_listen(tmp_path: Path, listen: str) -> None:
    result = run_hub_cli(["serve", "--root", tmp_path, "--listen", listen])
    assert_one_line_error(result, "listen address")
    assert result.returncode == 2


def test_cli_missing_root_option() -> None:
    result = run_hub_cli(["serve"])
    assert_one_line_error(result, "--root")


def test_cli_help_describes_serve() -> None:
    result = run_hub_cli(["serve", "--help"])
    assert result.returncode == 0
    for needle in ("--root", "--listen", "--log-level", "127.0.0.1:8470", "port 0"):
        assert needle in result.stdout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_promptly_with_exit_0(tmp_path: Path, signum: signal.Signals) -> None:
    (tmp_path / "f").write_bytes(b"data")
    with running_hub(tmp_path) as hub:
        idle = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
        idle.request("GET", "/healthz")  # keep-alive connection left open
        assert idle.getresponse().read()
        started = time.monotonic()
        hub.proc.send_signal(signum)
        returncode = hub.proc.wait(timeout=5)
        elapsed_s = time.monotonic() - started
        idle.close()
    assert returncode == 0
    assert elapsed_s < 5
    assert "Traceback" not in hub.stderr_text()
    with pytest.raises(OSError):
        socket.create_connection((hub.host, hub.port), timeout=2).close()
