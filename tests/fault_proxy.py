"""A fault-injecting HTTP proxy between spoke and hub, for tests.

It forwards every request to the hub and, for file data, batch and
checksum requests, injects a fault with probability `fault_rate`: a 503, a dropped
connection before the answer, a body cut short, one flipped bit, or a
stall. The manifest passes untouched (mounting stays possible). Runs its
own asyncio loop in a thread; `counts` says what was injected. `delay_s`
holds every data request (file ranges and batches, not checksums) that long
before forwarding it, a slow link; with `delay_min_bytes` only file ranges
at least that long (read-ahead's runs, not single-block misses).
`counts["delayed"]` says how many it held, `data_in_flight` how many data
requests it holds or forwards now, `most_data_in_flight` the most at once.
`stall_batches_after` sends that many bytes of every batch answer, then
holds the rest for `stall_s` (`counts["stalled batches"]`). `manifest_delay_s`
holds every manifest request that long (`counts["delayed manifests"]`).

    with running_fault_proxy(hub.url, fault_rate=0.3) as proxy:
        mount(proxy.url, ...)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

FAULTS = ("error", "drop", "truncate", "flip", "stall")
SESSION_KEY = web.AppKey("session", aiohttp.ClientSession)
_FORWARDED = ("Range", "Authorization", "Accept-Encoding")


@dataclass
class FaultProxy:
    hub_url: str
    fault_rate: float
    faults: tuple[str, ...] = FAULTS  # those to choose from
    stall_s: float = 1.0
    seed: int = 0
    enabled: bool = True
    delay_s: float = 0.0
    delay_min_bytes: int = 0
    stall_batches_after: int | None = None
    manifest_delay_s: float = 0.0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    url: str = ""
    data_in_flight: int = 0
    most_data_in_flight: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._stopping = asyncio.Event()

    def _choose(self, path: str) -> str | None:
        if not self.enabled or not path.startswith(("/v1/files/", "/v1/batch")):
            return None
        with self._lock:
            if self._rng.random() >= self.fault_rate:
                self.counts["none"] += 1
                return None
            fault = self._rng.choice(self.faults)
            self.counts[fault] += 1
            return fault

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/manifest" and self.manifest_delay_s:
            self.counts["delayed manifests"] += 1
            await self._hold(self.manifest_delay_s)
        if not _is_data(request.path):
            return await self._forward(request)
        self.data_in_flight += 1  # the proxy's event loop is its only thread
        self.most_data_in_flight = max(self.most_data_in_flight, self.data_in_flight)
        try:
            if _range_bytes(request) >= self.delay_min_bytes:
                self.counts["delayed"] += 1
                await self._hold(self.delay_s)
            return await self._forward(request)
        finally:
            self.data_in_flight -= 1

    async def _hold(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):  # cut short when the proxy stops
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        session = request.app[SESSION_KEY]
        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        fault = self._choose(request.path)
        if fault == "error":
            return web.json_response({"error": "injected fault"}, status=503)
        if fault == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)  # never reaches the client
        try:
            async with session.get(self.hub_url + request.path_qs, headers=headers, auto_decompress=False) as upstream:
                body = await upstream.read()
                status, upstream_headers = upstream.status, upstream.headers
        except aiohttp.ClientError:
            return web.json_response({"error": "hub unreachable"}, status=502)
        response = web.StreamResponse(status=status)
        for name in ("Content-Type", "Content-Range", "Content-Encoding", "ETag", "Cache-Control", "Accept-Ranges",
                     "Cachefs-Block-Sums", "Cachefs-Batch-Sums"):
            if name in upstream_headers:
                response.headers[name] = upstream_headers[name]
        response.content_length = len(body)
        await response.prepare(request)
        if fault == "truncate" and len(body) > 1:
            await response.write(body[: len(body) // 2])
            assert request.transport is not None
            request.transport.close()
            return response
        if fault == "flip" and body:
            flipped = bytearray(body)
            flipped[self._rng.randrange(len(flipped))] ^= 1 << self._rng.randrange(8)
            body = bytes(flipped)
        cut = self._stall_cut(request.path, fault, len(body))
        if cut is not None:
            await response.write(body[:cut])
            await asyncio.sleep(self.stall_s)
            body = body[cut:]
        await response.write(body)
        await response.write_eof()
        return response

    def _stall_cut(self, path: str, fault: str | None, length: int) -> int | None:
        """Where the body of an answer is held for `stall_s`, if it is."""
        if fault == "stall":
            return length // 2
        if self.stall_batches_after is not None and path.startswith("/v1/batch"):
            self.counts["stalled batches"] += 1
            return self.stall_batches_after
        return None


def _is_data(path: str) -> bool:
    """A request for file bytes: a ranged file read or a batch of small files."""
    return path.startswith("/v1/batch") or (path.startswith("/v1/files/") and not path.endswith("/checksums"))


def _range_bytes(request: web.Request) -> int:
    """The length of the byte range a request asks for (0 without one)."""
    value = request.headers.get("Range", "")
    start, _, end = value.removeprefix("bytes=").partition("-")
    return int(end) - int(start) + 1 if start.isdigit() and end.isdigit() else 0


@contextlib.contextmanager
def running_fault_proxy(hub_url: str, fault_rate: float, **options: object) -> Iterator[FaultProxy]:
    """A FaultProxy on 127.0.0.1 (ephemeral port) for the duration of the block."""
    proxy = FaultProxy(hub_url, fault_rate, **options)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner_box: list[web.AppRunner] = []

    async def start() -> None:
        app = web.Application()
        app[SESSION_KEY] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
        app.router.add_get("/{tail:.*}", proxy.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        proxy.url = f"http://127.0.0.1:{port}"
        runner_box.append(runner)
        started.set()

    async def stop() -> None:
        proxy._stopping.set()
        runner = runner_box[0]
        await runner.app[SESSION_KEY].close()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=20)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout=20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=20)
        loop.close()
