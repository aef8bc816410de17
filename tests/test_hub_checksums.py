"""The hub's block checksums endpoint, through a real hub and the standard library's client."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import xxhash
from hub_helpers import fetch_manifest, running_hub, wait_until
from prometheus_client.parser import text_string_to_metric_families

from cachefs.cache import BlockKey
from cachefs.config import parse_hub_url
from cachefs.fetch.hub_checksums import BlockChecksums
from cachefs.fetch.hub_client import HubClient
from hubserver.checksums import ChecksumCache, SumsAsked
from hubserver.errors import FileChangedError, RequestAbandoned
from hubserver.files import open_unchanged
from hubserver.scan import scan

KiB = 1024


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_checksums_match_the_blocks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000 + b"tail"  # 256,004 bytes: 3 full 64 KiB blocks and a short one
    (tmp_path / "f.bin").write_bytes(data)
    with running_hub(tmp_path) as hub:
        entry = fetch_manifest(hub).files()["f.bin"]
        base = f"{hub.url}/v1/files/{entry['i']}/checksums?v={entry['v']}&bs={64 * KiB}"
        status, body = get(base + "&first=1&count=10")
        assert status == 200 and len(body) == 3 * 8  # blocks 1, 2, 3: the answer stops at the end of the file
        expected = [xxhash.xxh3_64_intdigest(data[b * 64 * KiB : (b + 1) * 64 * KiB]) for b in (1, 2, 3)]
        assert [int.from_bytes(body[i : i + 8], "big") for i in range(0, 24, 8)] == expected
        assert get(base + "&first=0&count=1")[1] == get(base + "&first=0&count=1")[1]  # remembered, same answer
        for bad in ("&first=0&count=0", "&first=-1&count=1", "&first=0&count=99999", "&first=x&count=1",
                    "&first=%C2%B2&count=1", "&first=0&count=%D9%A1"):  # "²", an Arabic-Indic 1: digits, not ASCII
            assert get(base + bad)[0] == 400, bad
        assert get(f"{hub.url}/v1/files/{entry['i']}/checksums?v={entry['v']}&bs=100000&first=0&count=1")[0] == 400
        assert get(base + "&first=4&count=1")[0] == 416
        assert get(base.replace(entry["v"], "0" * 16) + "&first=0&count=1")[0] == 412
        assert get(base.replace(entry["i"], "f" * 16) + "&first=0&count=1")[0] == 404
        (tmp_path / "f.bin").write_bytes(data + b"changed")
        assert get(base + "&first=3&count=1")[0] == 412  # changed on disk since the scan


def get_with_headers(url: str, range_header: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Range": range_header} if range_header else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def head_of(url: str, range_header: str | None = None, method: str = "GET") -> dict[str, str]:
    """The headers of an answer, its body left unread (the hub computes the sums before them)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.netloc, timeout=30)
    try:
        connection.request(method, f"{parts.path}?{parts.query}", headers={"Range": range_header} if range_header else {})
        return dict(connection.getresponse().headers)
    finally:
        connection.close()


def test_data_answers_carry_the_sums_of_the_blocks_they_cover_whole(tmp_path: Path) -> None:
    block = 64 * KiB
    data = bytes(range(256)) * 1000 + b"tail"  # blocks 0-2 full, block 3 short
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "big.bin").write_bytes(bytes(70 * block))
    with running_hub(tmp_path) as hub:
        entries = fetch_manifest(hub).files()
        entry = entries["f.bin"]
        url = f"{hub.url}/v1/files/{entry['i']}?v={entry['v']}"
        sums = [xxhash.xxh3_64_intdigest(data[b * block : (b + 1) * block]).to_bytes(8, "big").hex() for b in range(4)]

        status, headers, body = get_with_headers(url + f"&bs={block}", f"bytes={block}-{2 * block - 1}")
        assert status == 206 and body == data[block : 2 * block]
        assert headers["Cachefs-Block-Sums"] == f"bs={block}; first=1; {sums[1]}"
        # A range across blocks (as a cache's larger slice would ask): the blocks it covers
        # whole, so that the hub hashes no byte it does not send.
        status, headers, body = get_with_headers(url + f"&bs={block}", f"bytes=100-{3 * block + 5}")
        assert status == 206 and body == data[100 : 3 * block + 6]
        assert headers["Cachefs-Block-Sums"] == f"bs={block}; first=1; {sums[1]},{sums[2]}"
        status, headers, body = get_with_headers(url + f"&bs={block}", f"bytes={2 * block}-")  # the short last block too
        assert headers["Cachefs-Block-Sums"] == f"bs={block}; first=2; {sums[2]},{sums[3]}"
        for partial in ("bytes=0-0", f"bytes={block - 1}-{block}", f"bytes=1-{2 * block - 2}"):
            status, headers, body = get_with_headers(url + f"&bs={block}", partial)
            assert status == 206 and "Cachefs-Block-Sums" not in headers, partial
        status, headers, body = get_with_headers(url + f"&bs={block}")  # no Range: the whole file
        assert status == 200 and body == data and headers["Cachefs-Block-Sums"].endswith(",".join(sums))

        assert "Cachefs-Block-Sums" not in get_with_headers(url, "bytes=0-99")[1]  # not asked for
        big = entries["big.bin"]
        big_url = f"{hub.url}/v1/files/{big['i']}?v={big['v']}&bs={block}"
        assert "Cachefs-Block-Sums" not in get_with_headers(big_url)[1]  # 70 blocks: too many for a header
        for bad in ("&bs=1000", "&bs=100000", "&bs=x", f"&bs={block}&bs={block}"):
            assert get_with_headers(url + bad, "bytes=0-99")[0] == 400, bad
        assert get_with_headers(url + f"&bs={block}", "bytes=999999-")[0] == 416
        (tmp_path / "f.bin").write_bytes(data + b"changed")
        assert get_with_headers(url + f"&bs={block}", "bytes=0-99")[0] == 412


def test_checksum_requests_never_hold_up_other_requests(tmp_path: Path) -> None:
    """Clients asking for the sums of many large blocks (and going away) keep the hub's
    hashing threads busy, not the threads that open files for everyone else; one request
    hashes at most 256 MiB."""
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(24 << 30)  # sparse: hashing holes costs CPU, no disk
    (tmp_path / "small.bin").write_bytes(b"s" * 100)
    with running_hub(tmp_path) as hub:
        files = fetch_manifest(hub).files()
        big, small = files["big.bin"], files["small.bin"]
        base = f"{hub.url}/v1/files/{big['i']}/checksums?v={big['v']}&bs={64 << 20}"
        assert get(base + "&first=0&count=5")[0] == 400  # 5 x 64 MiB: more than 256 MiB of hashing

        def ask_and_leave(first: int) -> None:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{base}&first={first}&count=4", timeout=0.3).read()

        askers = [threading.Thread(target=ask_and_leave, args=(first,)) for first in range(0, 24, 4)]
        for asker in askers:  # six requests of 256 MiB of hashing each: as many as the default executor's threads
            asker.start()
        for asker in askers:
            asker.join()
        started = time.monotonic()
        status, body = get(f"{hub.url}/v1/files/{small['i']}?v={small['v']}")
        waited_s = time.monotonic() - started
    assert (status, body) == (200, b"s" * 100)
    assert waited_s < 1.0, waited_s


def test_concurrent_requests_for_the_same_sums_share_one_computation(tmp_path: Path) -> None:
    """Spokes starting cold on one dataset ask for the same checksums at once: the hub reads
    and hashes each block once (cachefs_hub_hashed_bytes_total), all get the sums."""
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(256 << 20)  # sparse: 64 blocks of 4 MiB
    with running_hub(tmp_path) as hub:
        big = fetch_manifest(hub).files()["big.bin"]
        url = f"{hub.url}/v1/files/{big['i']}/checksums?v={big['v']}&bs={4 << 20}&first=0&count=64"
        answers: list[tuple[int, bytes]] = []

        def ask() -> None:
            answers.append(get(url))

        askers = [threading.Thread(target=ask) for _ in range(3)]
        for asker in askers:
            asker.start()
            time.sleep(0.1)  # while the first is hashing
        for asker in askers:
            asker.join()
        ask()  # afterwards: remembered
        hashed = hashed_bytes(hub.url)
    assert [status for status, _body in answers] == [200] * 4
    assert len({body for _status, body in answers}) == 1
    assert hashed == 256 << 20  # once, not once per request


def test_the_hub_stops_hashing_for_a_client_that_went_away(tmp_path: Path) -> None:
    """A client asking for the sums of many blocks and leaving (a spoke's request timed out,
    a spoke stopped) does not keep a hashing thread reading and hashing the rest."""
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(256 << 20)  # sparse: 64 blocks of 4 MiB
    with running_hub(tmp_path) as hub:
        big = fetch_manifest(hub).files()["big.bin"]
        url = f"{hub.url}/v1/files/{big['i']}/checksums?v={big['v']}&bs={4 << 20}&first=0&count=64"
        host, port = urllib.parse.urlsplit(hub.url).hostname, urllib.parse.urlsplit(hub.url).port
        with socket.create_connection((host, port), timeout=10) as client:
            client.sendall(f"GET {urllib.parse.urlsplit(url).path}?{urllib.parse.urlsplit(url).query} HTTP/1.1\r\n"
                           f"Host: {host}\r\n\r\n".encode())
            assert wait_until(lambda: hashed_bytes(hub.url) > 0, 10)  # hashing, and the client goes away
        hashed, deadline = -1.0, time.monotonic() + 60
        while time.monotonic() < deadline:  # until the hashing stopped
            time.sleep(0.5)
            hashed, before = hashed_bytes(hub.url), hashed
            if hashed == before:
                break
        with urllib.request.urlopen(url, timeout=120) as response:  # for a client that stays: all of them,
            body = response.read()  # and what was hashed is not hashed again
        total = hashed_bytes(hub.url)
    assert hashed < 128 << 20, hashed  # before: all 256 MiB
    assert len(body) == 64 * 8
    assert total == 256 << 20, (hashed, total)


def hub_metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric `name` with (at least) these labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def hashed_bytes(url: str, **labels: str) -> float:
    return hub_metric(url, "cachefs_hub_hashed_bytes_total", **labels)


def test_sums_a_request_stopped_computing_are_computed_once_by_the_others(tmp_path: Path) -> None:
    """A leaves (its client went away) while B waits for its computation: B claims the rest,
    and C, arriving meanwhile, waits for B instead of hashing them again (in process: the
    ChecksumCache of a scanned tree, ~10 ms per block)."""
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(128 << 20)  # sparse: 128 blocks of 1 MiB
    snapshot = scan(tmp_path)
    record = next(iter(snapshot.files_by_id.values()))
    hashed: list[int] = []

    def on_hashed(_endpoint: str, length: int) -> None:
        hashed.append(length)
        time.sleep(0.01)

    cache = ChecksumCache(on_hashed=on_hashed)
    a_connected = threading.Event()
    a_connected.set()
    results: dict[str, object] = {}

    def ask(name: str, wanted: Callable[[], bool]) -> None:
        try:
            results[name] = cache.block_sums(SumsAsked(snapshot, record, 1 << 20, 0, 128, wanted=wanted))
        except RequestAbandoned:
            results[name] = "abandoned"

    askers = {"A": threading.Thread(target=ask, args=("A", a_connected.is_set))}
    askers["A"].start()
    time.sleep(0.1)
    askers["B"] = threading.Thread(target=ask, args=("B", lambda: True))
    askers["B"].start()
    time.sleep(0.1)
    a_connected.clear()  # A's client leaves
    time.sleep(0.5)  # B computes the rest
    askers["C"] = threading.Thread(target=ask, args=("C", lambda: True))
    askers["C"].start()
    for asker in askers.values():
        asker.join(timeout=60)
    expected = b"".join(xxhash.xxh3_64_intdigest(bytes(1 << 20)).to_bytes(8, "big") for _ in range(128))
    assert results == {"A": "abandoned", "B": expected, "C": expected}
    assert sum(hashed) == 128 << 20  # each block once (before: ~237 MiB)


def test_the_hashing_one_request_causes_is_bounded(tmp_path: Path) -> None:
    """The worst requests for hashing: a data request hashes no more than it sends (a byte
    with bs=64M used to hash 64 MiB), a checksums request at most 256 MiB (it used to be
    4 GiB); cachefs_hub_hashed_bytes_total counts it all."""
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(512 << 20)  # sparse: 8 blocks of 64 MiB
    with running_hub(tmp_path) as hub:
        big = fetch_manifest(hub).files()["big.bin"]
        data_url = f"{hub.url}/v1/files/{big['i']}?v={big['v']}"
        sums_url = f"{hub.url}/v1/files/{big['i']}/checksums?v={big['v']}"
        for bs in (64 << 20, 64 * KiB):
            for range_header in ("bytes=0-0", f"bytes={bs - 1}-{bs}", "bytes=-1"):
                status, headers, body = get_with_headers(f"{data_url}&bs={bs}", range_header)
                assert status == 206 and "Cachefs-Block-Sums" not in headers, (bs, range_header)
        status, headers, body = get_with_headers(f"{data_url}&bs={64 * KiB}", f"bytes=1-{3 * 64 * KiB - 1}")
        assert headers["Cachefs-Block-Sums"].startswith(f"bs={64 * KiB}; first=1; ")  # blocks 1 and 2, sent whole
        # Sums in the header for at most 256 MiB, as the checksums endpoint; none for a HEAD (no body).
        assert "Cachefs-Block-Sums" in head_of(f"{data_url}&bs={64 << 20}", f"bytes=0-{(256 << 20) - 1}")
        assert "Cachefs-Block-Sums" not in head_of(f"{data_url}&bs={64 << 20}", f"bytes=0-{(320 << 20) - 1}")
        assert "Cachefs-Block-Sums" not in head_of(f"{data_url}&bs={32 << 20}", method="HEAD")
        for too_much in ("bs=67108864&first=0&count=5", "bs=65536&first=0&count=4097", "bs=1048576&first=0&count=257"):
            assert get(f"{sums_url}&{too_much}")[0] == 400, too_much
        for most in ("bs=67108864&first=4&count=4", "bs=65536&first=0&count=4096"):
            status, body = get(f"{sums_url}&{most}")
            assert status == 200 and len(body) in (4 * 8, 4096 * 8), most
        files_hashed, files_sent = hashed_bytes(hub.url, endpoint="files"), hub_metric(
            hub.url, "cachefs_hub_sent_bytes_total", endpoint="files")
        checksums_hashed = hashed_bytes(hub.url, endpoint="checksums")
    assert files_hashed == 2 * 64 * KiB + (256 << 20)  # not the 320 MiB range's, nor the HEAD's 512 MiB
    assert files_sent >= 2 * 64 * KiB
    assert checksums_hashed == 2 * (256 << 20) - 2 * 64 * KiB  # less the two blocks the data request summed


def test_one_client_asking_for_many_sums_leaves_hashing_threads_to_others(tmp_path: Path) -> None:
    """One client's many requests for sums take at most half the hashing threads: another
    client's request is answered before any of them (it used to queue behind them)."""
    block = 4 << 20
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(8 * 64 * block)  # sparse: 8 spans of 64 blocks of 4 MiB
    (tmp_path / "small.bin").write_bytes(b"s" * 100)
    with running_hub(tmp_path) as hub:
        files = fetch_manifest(hub).files()
        big, small = files["big.bin"], files["small.bin"]
        host, port = urllib.parse.urlsplit(hub.url).hostname, urllib.parse.urlsplit(hub.url).port
        first_client = []
        try:
            for span in range(8):
                sock = socket.create_connection((host, port), timeout=10)
                first_client.append(sock)
                sock.sendall(f"GET /v1/files/{big['i']}/checksums?v={big['v']}&bs={block}&first={64 * span}&count=64 "
                             f"HTTP/1.1\r\nHost: hub\r\n\r\n".encode())
            assert wait_until(lambda: hashed_bytes(hub.url) > 0, 10)
            other = http.client.HTTPConnection(host, port, timeout=30, source_address=("127.0.0.2", 0))
            other.request("GET", f"/v1/files/{small['i']}/checksums?v={small['v']}&bs={64 * KiB}&first=0&count=1")
            assert other.getresponse().read() == xxhash.xxh3_64_intdigest(b"s" * 100).to_bytes(8, "big")
            other.close()
            answered_before = 0
            for sock in first_client:
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    answered_before += bool(sock.recv(1))
        finally:
            for sock in first_client:
                sock.close()
    assert answered_before == 0


def test_a_spoke_with_the_largest_blocks_asks_for_sums_within_the_bound(tmp_path: Path) -> None:
    """A spoke with 64 MiB blocks asks for fewer blocks' sums at once (4, not 64), so the
    hub's bound on one checksums request never refuses it."""
    block = 64 << 20
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(5 * block)  # sparse
    with running_hub(tmp_path) as hub:
        big = fetch_manifest(hub).files()["big.bin"]

        async def ask() -> list[int]:
            client = HubClient(parse_hub_url(hub.url), max_connections=2, connect_timeout_s=5, read_timeout_s=30)
            try:
                first = BlockKey(bytes.fromhex(big["i"]), bytes.fromhex(big["v"]), 3)
                return await BlockChecksums(client, block).expected(first, 2)  # blocks 3 and 4: two spans
            finally:
                await client.aclose()

        sums = trio.run(ask)
        hashed = hashed_bytes(hub.url, endpoint="checksums")
    assert sums == [xxhash.xxh3_64_intdigest(bytes(block))] * 2
    assert hashed == 5 * block  # span 0 (blocks 0-3) and span 1 (block 4)


def test_sums_of_a_file_rewritten_in_place_after_its_open_check_are_refused(tmp_path: Path) -> None:
    """A data request's descriptor is checked when it is opened; a write in place (same
    size) that lands before its blocks are hashed must not have the hub send, and
    remember, the new bytes' sums as the scanned version's (the spoke would cache a mix
    of both versions under the old one)."""
    old, new = b"a" * (2 << 20), b"b" * (2 << 20)
    (tmp_path / "f.bin").write_bytes(old)
    snapshot = scan(tmp_path)
    record = next(iter(snapshot.files_by_id.values()))
    fd = open_unchanged(snapshot, record)  # what a data request holds when it asks for its sums
    rewritten = threading.Event()

    def wanted() -> bool:  # asked before each block is read: rewrite the file before the first
        if not rewritten.is_set():
            with open(tmp_path / "f.bin", "r+b") as f:
                f.write(new)
            rewritten.set()
        return True

    cache = ChecksumCache()
    try:
        with pytest.raises(FileChangedError):
            cache.block_sums(SumsAsked(snapshot, record, 1 << 20, 0, 2, fd=fd, wanted=wanted))
        with pytest.raises(FileChangedError):  # nothing of the new bytes was remembered for the old version
            cache.block_sums(SumsAsked(snapshot, record, 1 << 20, 0, 2))
    finally:
        os.close(fd)
        cache.close()
