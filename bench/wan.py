"""A WAN emulator: a TCP proxy on loopback adding one-way delay and an optional rate cap.

This kernel has no tc netem, so the link is emulated in user space. Each
direction is a *link* shared by all connections: a chunk read from one side
waits for the link to be free (serialization at `rate_bytes_per_s`), then
travels `delay_s` before it is written to the other side. Reading never
waits for earlier chunks to be delivered, so TCP streaming and pipelining
stay intact: a connection keeps up to `QUEUE_CHUNKS` chunks in flight, like
a window sized for the bandwidth-delay product.

    python -m bench.wan --target 127.0.0.1:8470 --delay-ms 30 --rate-mbit 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import signal
import sys

import trio

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
# 512 x 256 KiB = 128 MiB per connection and direction: more than the
# bandwidth-delay product of 1 GB/s x 60 ms, so the window never limits.
QUEUE_CHUNKS = 512


@dataclasses.dataclass
class Link:
    """One direction of the emulated link."""

    delay_s: float
    rate_bytes_per_s: float = math.inf
    free_at: float = 0.0  # when the link finishes sending what it has accepted
    bytes_carried: int = 0  # accepted from the sending side
    bytes_delivered: int = 0  # written to the receiving side: what crossed the WAN

    def due_time(self, now: float, size: int) -> float:
        """When a chunk of `size` bytes arriving `now` reaches the other side."""
        start = max(now, self.free_at)
        self.free_at = start + size / self.rate_bytes_per_s
        self.bytes_carried += size
        return self.free_at + self.delay_s


@dataclasses.dataclass
class WanEmulator:
    """Listens on `listen_host`:`port` and forwards to `target`."""

    target_host: str
    target_port: int
    upstream: Link  # client -> target
    downstream: Link  # target -> client
    connections: int = 0

    async def serve(self, listen_host: str, listen_port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(listen_port, host=listen_host)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        try:
            server = await trio.open_tcp_stream(self.target_host, self.target_port)
        except OSError as exc:
            log.info("cannot reach target: %s", exc)
            await client.aclose()
            return
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, server, self.upstream, nursery.cancel_scope)
            nursery.start_soon(_pump, server, client, self.downstream, nursery.cancel_scope)

    def summary(self) -> str:
        """One line with the bytes that crossed the link each way (printed on exit by the CLI)."""
        return (
            f"wan carried {self.downstream.bytes_delivered} bytes downstream, "
            f"{self.upstream.bytes_delivered} bytes upstream, {self.connections} connections"
        )


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, link: Link, scope: trio.CancelScope) -> None:
    send_channel, receive_channel = trio.open_memory_channel[tuple[float, bytes]](QUEUE_CHUNKS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_deliver, receive_channel, sink, link, scope)
        async with send_channel:
            while True:
                try:
                    data = await source.receive_some(CHUNK_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                await send_channel.send((link.due_time(trio.current_time(), len(data)), data))


async def _deliver(
    channel: trio.MemoryReceiveChannel[tuple[float, bytes]],
    sink: trio.SocketStream,
    link: Link,
    scope: trio.CancelScope,
) -> None:
    async with channel:
        async for due, data in channel:
            await trio.sleep_until(due)
            try:
                await sink.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                scope.cancel()
                return
            link.bytes_delivered += len(data)
    # The source closed: pass the half-close on after the last chunk.
    try:
        await sink.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        scope.cancel()


def make_emulator(target: str, delay_ms: float, rate_mbit: float | None) -> WanEmulator:
    host, _, port = target.rpartition(":")
    rate = rate_mbit * 1e6 / 8 if rate_mbit else math.inf
    return WanEmulator(host, int(port), Link(delay_ms / 1000, rate), Link(delay_ms / 1000, rate))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (default: 127.0.0.1:0)")
    parser.add_argument("--delay-ms", type=float, default=30.0,
                        help="one-way delay per direction (default: 30 = 60 ms RTT)")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="rate cap per direction in Mbit/s (default: none)")
    args = parser.parse_args(argv)
    emulator = make_emulator(args.target, args.delay_ms, args.rate_mbit)
    host, _, port = args.listen.rpartition(":")

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(emulator.serve, host, int(port))
                print(f"wan listening on http://{host}:{bound}", flush=True)
                async for _signum in signals:
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    # SIGTERM/SIGINT stop it cleanly; the last line says what crossed the link.
    print(emulator.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
