"""The spoke's side of the regional tier (cachefs/fetch/tier_client.py): which node owns which
slice, how ranges are cut at slices, and failing over to the next node and the hub.

The failover tests use a real hub (it speaks the protocol a tier node passes on, so
it stands in for a live node), ports nobody listens on for dead nodes, and a raw
server answering 502 for a node whose hub is unreachable.
"""

from __future__ import annotations

import functools
import json
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from hub_helpers import HubProcess, free_port, read_request_head

from cachefs.config import parse_hub_url
from cachefs.errors import BatchUnsupported, RemoteFileChanged
from cachefs.fetch.tier_client import HUB, TierClient, slice_owners, split_at_slices
from cachefs.metrics import Stats

KiB = 1024
MiB = 1024 * KiB
SHARD = "shards/shard-000.bin"  # 3 MiB + 17 bytes (tests/dataset.py)


def test_each_slice_has_one_owner_and_an_appended_node_takes_only_its_share() -> None:
    slices = [(f"{file:016x}", number) for file in range(300) for number in range(100)]
    owners = Counter(slice_owners(file_id, number, 3)[0] for file_id, number in slices)
    assert all(abs(count - len(slices) / 3) < 0.03 * len(slices) for count in owners.values()), owners
    moved = 0
    for file_id, number in slices:
        before, after = slice_owners(file_id, number, 3), slice_owners(file_id, number, 4)
        assert sorted(before) == [0, 1, 2]
        assert after[0] in (before[0], 3)  # a slice moves only to the new node
        assert [node for node in after if node != 3] == before  # and the failover order of the others stays
        moved += after[0] == 3
    assert 0.22 < moved / len(slices) < 0.28  # about a quarter: the new node's share


def test_a_range_is_cut_at_slice_boundaries() -> None:
    # Blocks smaller than a slice: grouped, one request per slice.
    parts = split_at_slices(1 * MiB, [256 * KiB] * 6, 1 * MiB)
    assert [(part.start, part.lengths, part.piece_of) for part in parts] == [
        (1 * MiB, [256 * KiB] * 4, [0, 1, 2, 3]),
        (2 * MiB, [256 * KiB] * 2, [4, 5]),
    ]
    # A block larger than a slice, the file's last one short: cut into slices.
    parts = split_at_slices(4 * MiB, [4 * MiB, MiB + 17], 1 * MiB)
    assert [(part.start, part.lengths, part.piece_of) for part in parts] == [
        (4 * MiB, [MiB], [0]), (5 * MiB, [MiB], [0]), (6 * MiB, [MiB], [0]), (7 * MiB, [MiB], [0]),
        (8 * MiB, [MiB], [1]), (9 * MiB, [17], [1]),
    ]


def dead_url() -> str:
    """A loopback port with no listener: connections are refused at once."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(params=[502, 500])
async def gateway_error_url(nursery: trio.Nursery, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A node that answers every request 502, as nginx does when it cannot reach the hub, or
    500, as it does when it cannot read its cache file of the slice."""
    status = b"502 Bad Gateway" if request.param == 502 else b"500 Internal Server Error"

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            if await read_request_head(stream) is None:
                return
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    listeners = await nursery.start(functools.partial(trio.serve_tcp, answer, 0, host="127.0.0.1"))
    yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def tier(hub: HubProcess, nodes: list[str], stats: Stats, slice_bytes: int = MiB) -> TierClient:
    return TierClient(
        parse_hub_url(hub.url), [parse_hub_url(url) for url in nodes], slice_bytes=slice_bytes, stats=stats,
        max_connections=8, connect_timeout_s=5, read_timeout_s=5,
    )


async def shard_record(client: TierClient) -> tuple[str, str]:
    """(id, version) of SHARD in the manifest, which comes from the hub whatever the nodes do."""
    async for line in client.manifest_lines():
        entry = json.loads(line)
        if entry.get("p") == SHARD:
            return entry["i"], entry["v"]
    raise AssertionError(f"{SHARD} is not in the manifest")


@pytest.mark.trio
async def test_a_dead_node_is_skipped_and_its_slices_come_from_the_next(hub: HubProcess, dataset: Path) -> None:
    stats = Stats()
    client = tier(hub, [dead_url(), hub.url, dead_url()], stats)  # the hub stands in for a live node
    file_id, version = await shard_record(client)
    source = (dataset / SHARD).read_bytes()
    try:
        # One 4 MiB block of a 3 MiB + 17 file: four slices, each from its owner or the next.
        pieces, _ = await client.get_range(file_id, version, 0, [len(source)])
        assert [bytes(piece) for piece in pieces] == [source]
        assert stats.tier_requests == Counter({"0": 0, "1": 4, "2": 0, HUB: 0})
        first_failovers = stats.tier_failovers.copy()
        assert first_failovers["0"] >= 1 and first_failovers["2"] >= 1 and first_failovers["1"] == 0
        # Within NODE_DOWN_S the dead nodes are not asked again.
        pieces, sums = await client.get_range(file_id, version, MiB, [MiB], sums_block_size=MiB)
        assert bytes(pieces[0]) == source[MiB : 2 * MiB] and set(sums) == {1}
        assert stats.tier_failovers == first_failovers
        assert stats.tier_requests["1"] == 5
        assert client.answers == 1 + 5  # the manifest from the hub, the slices from the node: all count as upstream
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_without_a_live_node_the_hub_answers_and_its_refusals_are_not_failed_over(
    hub: HubProcess, dataset: Path, gateway_error_url: str
) -> None:
    stats = Stats()
    client = tier(hub, [dead_url(), gateway_error_url], stats)
    file_id, version = await shard_record(client)
    source = (dataset / SHARD).read_bytes()
    try:
        pieces, _ = await client.get_range(file_id, version, 2 * MiB, [MiB])
        assert bytes(pieces[0]) == source[2 * MiB : 3 * MiB]
        sums = await client.get_checksums(file_id, version, MiB, 0, 4)
        assert len(sums) == 4
        assert stats.tier_requests == Counter({"0": 0, "1": 0, HUB: 2})
        assert stats.tier_failovers["1"] == 2  # a 502 (or 500) fails over, but the node is asked again next time
        # 412 (another version) is the hub's answer, the same from any node: raised, not failed over.
        with pytest.raises(RemoteFileChanged):
            await client.get_range(file_id, "0123456789abcdef", 0, [MiB])
        assert stats.tier_requests[HUB] == 2
        with pytest.raises(BatchUnsupported):
            await client.get_batch([(file_id, version)], [len(source)], 4 * MiB, lambda *_: None)
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_a_node_answering_another_files_bytes_with_their_own_checksums_is_failed_over(
    hub: HubProcess, dataset: Path, nursery: trio.Nursery
) -> None:
    """A node whose cache hands out the wrong entry (its key lost the version, say) answers
    with that entry's bytes and checksums header, which agree: the ETag says whose they are."""
    stats = Stats()
    client = tier(hub, [hub.url], stats)
    entries = {}
    async for line in client.manifest_lines():
        entry = json.loads(line)
        entries[entry.get("p")] = entry
    await client.aclose()
    asked, other = entries[SHARD], entries["shards/shard-001.bin"]  # 3 MiB + 17 and 2 MiB
    wrong = f"{other['i']}?v={other['v']}".encode()

    async def misplaced(stream: trio.SocketStream) -> None:
        async with stream:
            head = await read_request_head(stream)
            if head is None:
                return
            head = head.replace(f"{asked['i']}?v={asked['v']}".encode(), wrong)
            head = head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
            upstream = await trio.open_tcp_stream(hub.host, hub.port)
            async with upstream:
                await upstream.send_all(head)
                try:
                    while data := await upstream.receive_some(65536):
                        await stream.send_all(data)
                except trio.BrokenResourceError:
                    pass  # the spoke hung up on the answer

    listeners = await nursery.start(functools.partial(trio.serve_tcp, misplaced, 0, host="127.0.0.1"))
    stats = Stats()
    client = tier(hub, [f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"], stats)
    source = (dataset / SHARD).read_bytes()
    try:
        pieces, sums = await client.get_range(asked["i"], asked["v"], 0, [MiB], sums_block_size=MiB)
        assert bytes(pieces[0]) == source[:MiB]
        assert stats.tier_failovers["0"] == 1 and stats.tier_requests[HUB] == 1
    finally:
        await client.aclose()


@pytest.mark.trio
@pytest.mark.parametrize("status", [b"403 Forbidden", b"404 Not Found"])
async def test_a_node_s_own_refusal_is_failed_over_not_taken_for_the_hub_s(
    hub: HubProcess, dataset: Path, nursery: trio.Nursery, status: bytes
) -> None:
    """A node that refuses the spoke itself (its allow list without the spoke's network, a URL
    that reaches nginx's default site) answers with a page of its own, not the hub's JSON
    error: the read goes to the next node or the hub, and the node is counted as failed."""

    async def refusing(stream: trio.SocketStream) -> None:
        async with stream:
            if await read_request_head(stream) is None:
                return
            page = b"<html><body>nginx</body></html>"
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/html\r\nContent-Length: "
                                  + str(len(page)).encode() + b"\r\nConnection: close\r\n\r\n" + page)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, refusing, 0, host="127.0.0.1"))
    stats = Stats()
    client = tier(hub, [f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"], stats)
    file_id, version = await shard_record(client)
    source = (dataset / SHARD).read_bytes()
    try:
        pieces, _ = await client.get_range(file_id, version, 0, [MiB])
        assert bytes(pieces[0]) == source[:MiB]
        assert len(await client.get_checksums(file_id, version, MiB, 0, 4)) == 4
        assert stats.tier_failovers["0"] == 1 and stats.tier_requests[HUB] == 2  # skipped for a while after it
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_http_nodes_beside_an_https_hub_are_spoken_to_in_plain_http(hub: HubProcess, dataset: Path) -> None:
    """The documented setup (docs/regional-tier.md): `https://` hub, `http://` nodes. The hub's TLS
    settings are for https:// URLs only; a node at an http:// URL gets no TLS handshake."""
    stats = Stats()
    https_hub = parse_hub_url(dead_url().replace("http://", "https://"))  # never asked: the node answers
    client = TierClient(https_hub, [parse_hub_url(hub.url)], slice_bytes=MiB, stats=stats, max_connections=8,
                        connect_timeout_s=5, read_timeout_s=5, ssl_context=ssl.create_default_context())
    plain = tier(hub, [], Stats())
    file_id, version = await shard_record(plain)
    await plain.aclose()
    source = (dataset / SHARD).read_bytes()
    try:
        pieces, _ = await client.get_range(file_id, version, 0, [MiB])
        assert bytes(pieces[0]) == source[:MiB]
        assert stats.tier_requests["0"] == 1 and stats.tier_failovers["0"] == 0
    finally:
        await client.aclose()
