"""The hub's batch endpoint (many small files in one answer), through a real hub."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import struct
import time
from pathlib import Path

import xxhash
from aiohttp.test_utils import TestClient, TestServer
from hub_helpers import HubProcess, fetch_manifest, http_get, running_hub

from hubserver import batch
from hubserver.app import make_app
from hubserver.config import HubConfig

KiB = 1024


def small_tree(root: Path) -> dict[str, bytes]:
    contents = {f"d/f{i}.bin": bytes([i]) * (1000 + 997 * i) for i in range(5)}
    contents["empty.bin"] = b""
    contents["big.bin"] = bytes(64 * KiB + 1)
    for relative, data in contents.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    return contents


def test_a_batch_answers_the_files_back_to_back_with_their_sums(tmp_path: Path) -> None:
    contents = small_tree(tmp_path)
    with running_hub(tmp_path) as hub:
        entries = fetch_manifest(hub).files()
        order = ["d/f3.bin", "d/f0.bin", "empty.bin", "d/f4.bin"]
        names = ",".join(f"{entries[p]['i']}.{entries[p]['v']}" for p in order)
        reply = http_get(hub, f"/v1/batch?bs={64 * KiB}&f={names}")
        assert reply.status == 200, reply.body
        assert reply.body == b"".join(contents[p] for p in order)
        assert reply.headers["content-length"] == str(len(reply.body))
        sums = [format(xxhash.xxh3_64_intdigest(contents[p]), "016x") for p in order]
        assert reply.headers["cachefs-batch-sums"] == ",".join(sums)
        assert "immutable" in reply.headers["cache-control"]


def test_a_batch_is_refused_whole(tmp_path: Path) -> None:
    small_tree(tmp_path)
    with running_hub(tmp_path) as hub:
        entries = fetch_manifest(hub).files()

        def name(path: str) -> str:
            return f"{entries[path]['i']}.{entries[path]['v']}"

        good = name("d/f1.bin")
        for query, status in [
            (f"bs={64 * KiB}&f={good},{entries['d/f2.bin']['i']}.{'0' * 16}", 412),  # another version
            (f"bs={64 * KiB}&f={good},{'f' * 16}.{'0' * 16}", 412),  # not in the snapshot
            (f"bs={64 * KiB}&f={good},{name('big.bin')}", 400),  # larger than one block
            (f"bs={64 * KiB}&f=" + ",".join([good] * 65), 400),  # more than 64 files
            (f"bs={64 * KiB}&f=", 400),
            (f"bs={64 * KiB}&f={good};", 400),
            (f"bs={64 * KiB}&f={good.upper()}", 400),
            (f"bs=1000&f={good}", 400),  # not a power of two
            (f"f={good}", 400),  # no block size
            (f"bs={64 * KiB}&f={good}&f={good}", 400),
            (f"bs={64 * KiB}&f={good}&x=1", 400),
        ]:
            reply = http_get(hub, f"/v1/batch?{query}")
            assert reply.status == status, (query, reply.body)
            assert reply.headers["content-type"].startswith("application/json") and b"error" in reply.body
        # A file changed on disk since the scan: the whole batch is refused.
        (tmp_path / "d/f2.bin").write_bytes(b"changed")
        reply = http_get(hub, f"/v1/batch?bs={64 * KiB}&f={good},{name('d/f2.bin')}")
        assert reply.status == 412 and b"d/f2.bin" not in reply.body  # the answer names ids, never paths
        assert http_get(hub, f"/v1/batch?bs={64 * KiB}&f={good}").status == 200


async def _batch_url_of_f2(client: TestClient) -> str:
    """The batch request of d/f2.bin in 64 KiB blocks, its id and version from the in-process hub's manifest."""
    manifest = await (await client.get("/v1/manifest", auto_decompress=False)).read()
    lines = gzip.decompress(manifest).splitlines()[1:]
    entries = {entry["p"]: entry for entry in map(json.loads, lines) if entry["k"] == "f"}
    return f"/v1/batch?bs={64 * KiB}&f={entries['d/f2.bin']['i']}.{entries['d/f2.bin']['v']}"


def test_batches_beyond_the_memory_slots_are_answered_503_until_one_is_free(tmp_path: Path) -> None:
    """The hub holds at most MAX_IN_MEMORY batches; one more is refused at once with
    Retry-After (the spoke retries), and taken again once a slot is free. In process,
    so that the test can hold the slots the way 32 slow readers would."""
    contents = small_tree(tmp_path)

    async def scenario() -> None:
        app = make_app(HubConfig(root=tmp_path, access_log=False))
        async with TestClient(TestServer(app)) as client:
            url = await _batch_url_of_f2(client)
            slots = app[batch.SLOTS_KEY]
            async with contextlib.AsyncExitStack() as others:
                for i in range(batch.MAX_IN_MEMORY - 1):  # all but one slot held by other clients' batches
                    await others.enter_async_context(slots.taken(f"192.0.2.{i}"))
                for _ in range(2):  # a batch frees its slot when answered: the last one serves one after another
                    reply = await client.get(url)
                    assert reply.status == 200
                    assert await reply.read() == contents["d/f2.bin"]
                async with slots.taken("192.0.2.200"):  # the last slot too
                    refused = await asyncio.wait_for(client.get(url), 10)  # at once, not after a slot frees
                    assert refused.status == 503
                    assert refused.headers["Retry-After"] == "1"
                    assert "batches under way" in (await refused.json())["error"]
                assert (await client.get(url)).status == 200

    asyncio.run(scenario())


def test_one_client_holds_at_most_half_the_memory_slots(tmp_path: Path) -> None:
    """A client with MAX_IN_MEMORY_PER_CLIENT batches under way gets 503 for one more,
    while the other slots stay free for other clients (in process, as above)."""
    contents = small_tree(tmp_path)

    async def scenario() -> None:
        app = make_app(HubConfig(root=tmp_path, access_log=False))
        async with TestClient(TestServer(app)) as client:
            url = await _batch_url_of_f2(client)
            slots = app[batch.SLOTS_KEY]
            async with contextlib.AsyncExitStack() as own:
                for _ in range(batch.MAX_IN_MEMORY_PER_CLIENT):
                    await own.enter_async_context(slots.taken("127.0.0.1"))
                refused = await asyncio.wait_for(client.get(url), 10)
                assert refused.status == 503 and refused.headers["Retry-After"] == "1"
                assert not slots.full("192.0.2.1")  # another client would be served
            reply = await client.get(url)
            assert reply.status == 200 and await reply.read() == contents["d/f2.bin"]

    asyncio.run(scenario())


def files_of(root: Path, size: int) -> dict[str, bytes]:
    """64 files of `size` bytes in `root`, by name."""
    contents = {f"f{i:02d}.bin": bytes([i]) * size for i in range(64)}
    for name, data in contents.items():
        (root / name).write_bytes(data)
    return contents


def batch_names(hub: HubProcess, contents: dict[str, bytes]) -> str:
    """The batch request's `f` of these files, from the hub's manifest."""
    entries = fetch_manifest(hub).files()
    return ",".join(f"{entries[name]['i']}.{entries[name]['v']}" for name in contents)


def test_clients_reading_batches_slowly_hold_no_slot(tmp_path: Path) -> None:
    """Batches are sent from their files' descriptors once hashed: MAX_IN_MEMORY clients
    that ask for 8 MiB batches and do not read them hold their connections, not the slots
    (before: every other client's batch was 503 for as long as they kept them)."""
    contents = files_of(tmp_path, 128 * KiB)
    with running_hub(tmp_path) as hub:
        names = batch_names(hub, contents)
        query = f"/v1/batch?bs={128 * KiB}&f={names}"
        slow = []
        try:
            for _ in range(batch.MAX_IN_MEMORY):
                client = socket.socket()
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never reads
                client.connect((hub.host, hub.port))
                client.sendall(f"GET {query} HTTP/1.1\r\nHost: hub\r\n\r\n".encode())
                slow.append(client)
            time.sleep(1.0)  # all of them hashed and being sent
            reply = http_get(hub, query)
            assert reply.status == 200, reply.body[:200]
            assert reply.body == b"".join(contents.values())
        finally:
            for client in slow:
                client.close()


def test_clients_that_reset_a_batch_part_way_are_no_error(tmp_path: Path) -> None:
    """A client that resets its connection while the hub opens the batch's next file is a
    client gone (499 in the access log), not an error with a traceback in the hub's log."""
    contents = files_of(tmp_path, 4 * KiB)
    with running_hub(tmp_path) as hub:
        names = batch_names(hub, contents)
        request = f"GET /v1/batch?bs={64 * KiB}&f={names} HTTP/1.1\r\nHost: hub\r\n\r\n".encode()
        for attempt in range(100):
            with socket.create_connection((hub.host, hub.port), timeout=10) as client:
                client.sendall(request)
                client.recv(1024 + 97 * attempt)  # the head and a part of the body
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        assert http_get(hub, f"/v1/batch?bs={64 * KiB}&f={names}").status == 200
        log = hub.stderr_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-2000:]
