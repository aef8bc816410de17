"""The spoke's HTTP client and manifest download against a hub that misbehaves (a raw server
in the test: answers no real hub gives): bounded memory and time, a clear error."""

from __future__ import annotations

import functools
import gzip
import json
import os
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio
from hub_helpers import read_request_head

from cachefs.config import parse_hub_url
from cachefs.errors import HubError, HubProtocolError, HubStatusError, HubUnavailable, RemoteFileChanged
from cachefs.fetch.hub_client import HubClient
from cachefs.namespace.snapshots import download_manifest

HEADER_LINE = json.dumps({"format": "cachefs-manifest", "format_version": 1, "generation": "g1"}).encode()
Body = Callable[[trio.SocketStream], Awaitable[None]]


async def _answer(stream: trio.SocketStream, head: bytes, body: Body) -> None:
    if await read_request_head(stream) is None:
        return
    await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n" + head + b"\r\n")
    await body(stream)


@pytest.fixture
async def raw_hub(nursery: trio.Nursery) -> AsyncIterator[Callable[[bytes, Body], str]]:
    """Serve every request with the response head fields and body writer given; returns the URL."""
    answer: list[tuple[bytes, Body]] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _answer(stream, *answer[-1])
            except trio.BrokenResourceError:  # the client gave up on the answer
                pass

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]

    def serve(head: bytes, body: Body) -> str:
        answer.append((head, body))
        return f"http://127.0.0.1:{port}"

    yield serve


def client_for(url: str) -> HubClient:
    return HubClient(parse_hub_url(url), max_connections=2, connect_timeout_s=5, read_timeout_s=5)


def sender(data: bytes) -> Body:
    async def send(stream: trio.SocketStream) -> None:
        await stream.send_all(data)

    return send


async def read_gzipped_manifest(raw_hub, gzipped: bytes) -> tuple[list[bytes], int, HubProtocolError | None]:
    """Serve `gzipped` as the manifest and read it: its lines, Python's peak allocation
    meanwhile, and the protocol error that ended it (if one did)."""
    client = client_for(raw_hub(b"Content-Encoding: gzip\r\nContent-Length: %d\r\n" % len(gzipped), sender(gzipped)))
    lines: list[bytes] = []
    error = None
    tracemalloc.start()
    try:
        try:
            async for line in client.manifest_lines():
                lines.append(line)
        except HubProtocolError as exc:
            error = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        await client.aclose()
    return lines, peak, error


@pytest.mark.trio
async def test_a_gzip_bomb_without_line_breaks_is_refused_in_bounded_memory(raw_hub) -> None:
    bomb = gzip.compress(HEADER_LINE + b"\n" + b"\0" * (256 << 20), compresslevel=9)  # 256 MiB in ~250 KiB
    lines, peak, error = await read_gzipped_manifest(raw_hub, bomb)
    assert error is not None and "manifest line longer than" in str(error)
    assert lines == [HEADER_LINE]
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB"


@pytest.mark.trio
async def test_a_gzip_bomb_of_empty_lines_is_inflated_in_bounded_pieces(raw_hub) -> None:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = compressor.compress(HEADER_LINE + b"\n" + b"\n" * (32 << 20)) + compressor.flush()
    lines, peak, error = await read_gzipped_manifest(raw_hub, bomb)
    assert error is None and lines == [HEADER_LINE]
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB"


def chunked_piece(data: bytes) -> bytes:
    """`data` as one piece of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


async def assert_given_up_soon(client: HubClient, path: Path) -> None:
    """A download that must keep 5 kB/s after 0.5 s fails for being too slow, within 3 s."""
    started = trio.current_time()
    with pytest.raises(HubError, match="manifest came too slowly"):
        await download_manifest(client, path, None, grace_s=0.5, min_bytes_per_s=5000)
    assert trio.current_time() - started < 3


def trickle(line_bytes: int, interval_s: float, lines: int) -> Body:
    """A chunked manifest: the header, then `lines` lines of `line_bytes`, one every `interval_s`."""

    async def send(stream: trio.SocketStream) -> None:
        await stream.send_all(chunked_piece(HEADER_LINE + b"\n"))
        entry = json.dumps({"p": "x" * (line_bytes - 30), "k": "d", "m": 493, "t": 0}).encode()[: line_bytes - 1]
        for _ in range(lines):
            await trio.sleep(interval_s)
            await stream.send_all(chunked_piece(entry + b"\n"))
        await stream.send_all(b"0\r\n\r\n")

    return send


@pytest.mark.trio
async def test_a_manifest_download_lasts_as_long_as_it_keeps_coming(raw_hub, tmp_path: Path) -> None:
    """Past its first `grace_s`, the download needs `min_bytes_per_s` on average: a large manifest
    over a slow link arrives whole, one that trickles is cut off."""
    chunked = b"Transfer-Encoding: chunked\r\n"
    url = raw_hub(chunked, trickle(line_bytes=1000, interval_s=0.1, lines=25))  # 10 kB/s for 2.5 s
    client = client_for(url)
    try:
        generation = await download_manifest(client, tmp_path / "m.gz", None, grace_s=0.5, min_bytes_per_s=5000)
        assert generation == "g1"
        with gzip.open(tmp_path / "m.gz") as stream:
            assert len(stream.read().splitlines()) == 26
        raw_hub(chunked, trickle(line_bytes=1000, interval_s=0.5, lines=100))  # 2 kB/s
        await assert_given_up_soon(client, tmp_path / "m.gz")
    finally:
        await client.aclose()


def inflating(lines_per_piece: int, interval_s: float, pieces: int) -> Body:
    """A gzipped chunked manifest whose every ~100 wire bytes inflate to `lines_per_piece` lines."""

    async def send(stream: trio.SocketStream) -> None:
        compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
        entry = json.dumps({"p": "d", "k": "d", "m": 493, "t": 0}).encode() + b"\n"
        await stream.send_all(chunked_piece(compressor.compress(HEADER_LINE + b"\n") + compressor.flush(zlib.Z_SYNC_FLUSH)))
        for _ in range(pieces):
            await trio.sleep(interval_s)
            piece = compressor.compress(entry * lines_per_piece) + compressor.flush(zlib.Z_SYNC_FLUSH)
            await stream.send_all(chunked_piece(piece))
        await stream.send_all(chunked_piece(compressor.flush()) + b"0\r\n\r\n")

    return send


@pytest.mark.trio
async def test_a_manifest_that_inflates_buys_no_time(raw_hub, tmp_path: Path) -> None:
    """The rate a download must keep is counted in bytes as sent (gzipped): ~100 bytes a
    0.1 s that inflate to 400 kB/s of text are cut off like any trickle."""
    url = raw_hub(b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", inflating(1000, 0.1, 300))
    client = client_for(url)
    try:
        await assert_given_up_soon(client, tmp_path / "m.gz")
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_a_manifest_must_keep_to_its_header(raw_hub, tmp_path: Path) -> None:
    """More entries than the header announced, or a header without a generation, is no manifest."""
    lines = [dict(json.loads(HEADER_LINE), entries=2)] + [{"p": f"d{n}", "k": "d", "m": 493, "t": 0} for n in range(3)]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    url = raw_hub(b"Content-Length: %d\r\n" % len(body), sender(body))
    client = client_for(url)
    try:
        with pytest.raises(HubProtocolError, match="more entries than the 2 its header announced"):
            await download_manifest(client, tmp_path / "m.gz", None)
        body = json.dumps({"format": "cachefs-manifest", "format_version": 1}).encode() + b"\n"
        raw_hub(b"Content-Length: %d\r\n" % len(body), sender(body))
        with pytest.raises(HubProtocolError, match="header has no generation"):
            await download_manifest(client, tmp_path / "m.gz", None)  # before: "already loaded" (None == None)
    finally:
        await client.aclose()


# -- block bodies -------------------------------------------------------------------------------


@pytest.fixture
async def scripted_hub(nursery: trio.Nursery) -> AsyncIterator[Callable[[list[tuple[bytes, Body]]], str]]:
    """Answer the requests of one keep-alive connection with the scripted (head, body) answers, in
    turn, and keep it open until the client closes it."""
    script: list[tuple[bytes, Body]] = []

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                while script and await read_request_head(stream) is not None:
                    head, body = script.pop(0)
                    await stream.send_all(head)
                    await body(stream)
                while await stream.receive_some(4096):  # keep the connection open until the client closes it
                    pass
            except trio.BrokenResourceError:
                pass

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]

    def serve(answers: list[tuple[bytes, Body]]) -> str:
        script.extend(answers)
        return f"http://127.0.0.1:{port}"

    yield serve


def range_head(data: bytes) -> bytes:
    return b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-%d/%d\r\nContent-Length: %d\r\n\r\n" % (
        len(data) - 1, len(data), len(data))


BLOCK = os.urandom(256 << 10)


@pytest.mark.trio
async def test_a_block_that_trickles_in_slower_than_the_read_timeout_arrives_whole(scripted_hub) -> None:
    """A receive sleeps until the rest of its piece is there (SO_RCVLOWAT): bytes that keep coming,
    too few to finish the piece within a read timeout, are not taken for a silent hub."""

    async def trickle(stream: trio.SocketStream) -> None:
        for offset in range(0, len(BLOCK), 8 << 10):  # 32 pieces, ~1 s
            await stream.send_all(BLOCK[offset : offset + (8 << 10)])
            await trio.sleep(0.03)

    url = scripted_hub([(range_head(BLOCK), trickle), (range_head(BLOCK), sender(BLOCK))])
    client = HubClient(parse_hub_url(url), max_connections=1, connect_timeout_s=5, read_timeout_s=0.3)
    try:
        for _ in range(2):  # and the connection goes on
            pieces, _sums = await client.get_range("f", "v", 0, [len(BLOCK) // 2, len(BLOCK) // 2])
            assert b"".join(pieces) == BLOCK
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_a_hub_silent_in_the_middle_of_a_block_is_given_up_after_the_read_timeout(scripted_hub) -> None:
    async def half_then_silence(stream: trio.SocketStream) -> None:
        await stream.send_all(BLOCK[: len(BLOCK) // 3])
        await trio.sleep_forever()

    client = HubClient(parse_hub_url(scripted_hub([(range_head(BLOCK), half_then_silence)])), max_connections=1,
                       connect_timeout_s=5, read_timeout_s=0.3)
    started = trio.current_time()
    try:
        with pytest.raises(HubUnavailable, match="hub sent nothing for 0.3 s"):
            await client.get_range("f", "v", 0, [len(BLOCK)])
    finally:
        await client.aclose()
    assert trio.current_time() - started < 2


@pytest.mark.trio
async def test_a_hub_that_stops_answering_costs_one_read_timeout_not_one_per_idle_connection(scripted_hub) -> None:
    """A frozen hub (or tier node) with idle keep-alive connections: the first one that stays
    silent ends the attempt (a tier client then fails over), not a timeout for each of them."""
    url = scripted_hub([(range_head(BLOCK), sender(BLOCK)) for _ in range(6)])  # then silence on every connection
    client = HubClient(parse_hub_url(url), max_connections=6, connect_timeout_s=5, read_timeout_s=0.5)
    try:
        async with trio.open_nursery() as nursery:  # six connections, idle once answered
            for _ in range(6):
                nursery.start_soon(client.get_range, "f", "v", 0, [len(BLOCK)])
        started = trio.current_time()
        with pytest.raises(HubUnavailable, match="hub sent nothing for 0.5 s"):
            await client.get_range("f", "v", 0, [len(BLOCK)])
        assert trio.current_time() - started < 1.5  # not 0.5 s for each of the six, then a seventh
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_a_short_answer_after_a_block_on_the_same_connection_comes_at_once(scripted_hub) -> None:
    """After a body the socket wakes for any byte again: an answer shorter than the last piece
    (a 412 head) is read as it comes, not after the read timeout."""

    async def nothing(stream: trio.SocketStream) -> None:
        return None

    url = scripted_hub([(range_head(BLOCK), sender(BLOCK)),
                        (b"HTTP/1.1 412 Precondition Failed\r\nContent-Length: 0\r\n\r\n", nothing)])
    client = HubClient(parse_hub_url(url), max_connections=1, connect_timeout_s=5, read_timeout_s=3)
    try:
        pieces, _sums = await client.get_range("f", "v", 0, [len(BLOCK)])
        assert bytes(pieces[0]) == BLOCK
        started = trio.current_time()
        with pytest.raises(RemoteFileChanged):
            await client.get_range("f", "v", 0, [len(BLOCK)])
        assert trio.current_time() - started < 1
    finally:
        await client.aclose()


def _then(*steps: Body) -> Body:
    async def run(stream: trio.SocketStream) -> None:
        for step in steps:
            await step(stream)

    return run


async def _pause(stream: trio.SocketStream) -> None:
    await trio.sleep(0.2)


async def _close(stream: trio.SocketStream) -> None:
    await stream.send_eof()


CLOSED_IDLE = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.mark.trio
async def test_a_408_for_an_idle_connection_is_never_taken_for_the_next_answer(scripted_hub) -> None:
    """A server may close an idle keep-alive connection with a 408 (RFC 9112 9.5), sent while
    the client waits for nothing, or as the answer to the request it sends on it next: either
    way the request goes out again on a new connection."""
    url = scripted_hub([
        (range_head(BLOCK), _then(sender(BLOCK), _pause, sender(CLOSED_IDLE), _close)),  # 408 while idle
        (range_head(BLOCK), sender(BLOCK)),
        (CLOSED_IDLE, _close),  # 408 as the answer to a request on a reused connection
        (range_head(BLOCK), sender(BLOCK)),
    ])
    client = HubClient(parse_hub_url(url), max_connections=1, connect_timeout_s=5, read_timeout_s=3)
    try:
        for _ in range(3):
            pieces, _sums = await client.get_range("f", "v", 0, [len(BLOCK)])
            assert bytes(pieces[0]) == BLOCK
            await trio.sleep(0.3)
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_interim_answers_before_the_answer_are_skipped(scripted_hub) -> None:
    """100 Continue or 103 Early Hints from a proxy come before the real answer."""
    url = scripted_hub([(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + range_head(BLOCK), sender(BLOCK))])
    client = HubClient(parse_hub_url(url), max_connections=1, connect_timeout_s=5, read_timeout_s=3)
    try:
        pieces, _sums = await client.get_range("f", "v", 0, [len(BLOCK)])
        assert bytes(pieces[0]) == BLOCK
    finally:
        await client.aclose()


@pytest.mark.trio
async def test_an_unexpected_answer_is_read_only_as_far_as_its_error_message(scripted_hub) -> None:
    """A proxy that drops Range answers 200 with the whole file, and one in trouble answers with
    an HTML page: the error quotes the start of the body on one line, without reading the rest
    (which here never ends), so it comes at once."""
    page = b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n\t<body>bad gateway</body>\r\n</html>\r\n"

    async def page_then_more(stream: trio.SocketStream) -> None:
        await stream.send_all(page * 200)
        await trio.sleep_forever()

    url = scripted_hub([(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n", page_then_more)])
    client = HubClient(parse_hub_url(url), max_connections=1, connect_timeout_s=5, read_timeout_s=3)
    try:
        with pytest.raises(HubStatusError) as error:
            await client.get_range("f", "v", 0, [len(BLOCK)])
    finally:
        await client.aclose()
    assert str(error.value).startswith("hub answered 200: <html> <head><title>502 Bad Gateway</title></head> <body>")
    assert str(error.value).isprintable()
