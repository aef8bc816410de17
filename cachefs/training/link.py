"""What plan prefetch knows of the link to the hub: latency, RTT, delivery rate, the concurrency they call for."""

from __future__ import annotations

import collections
import math

from ..config import PREFETCH_INFLIGHT_BYTES

INITIAL_LATENCY_S = 0.1
RATE_SMOOTHING = 0.3  # weight of the newest sample in the averages
# Bytes in flight before the link is measured (config.PREFETCH_INFLIGHT_BYTES,
# whatever the block size): 1.6x the bandwidth-delay product of 1 Gbit/s at
# 60 ms. More would share the link among more blocks and delay the first
# batch, which a cold epoch waits for.
INITIAL_INFLIGHT_BYTES = PREFETCH_INFLIGHT_BYTES
MIN_CONCURRENCY_BLOCKS = 2
LINK_WINDOW_S = 10.0


class LinkEstimate:
    """Fetch latency (smoothed), RTT (the shortest one-block fetch) and delivery rate (the highest)
    over the last LINK_WINDOW_S, and the blocks in flight that keep the link busy: twice the
    bandwidth-delay product in bytes, as blocks of `block_size`, at most `slots` (the fetcher
    has more slots for smaller blocks: config.prefetch_connections)."""

    def __init__(self, block_size: int, slots: int) -> None:
        self._block_size = block_size
        self._slots = slots
        self.latency_s = INITIAL_LATENCY_S
        self.concurrency_blocks = max(MIN_CONCURRENCY_BLOCKS, min(INITIAL_INFLIGHT_BYTES // block_size, slots))
        self.rtt_s: float | None = None
        self.bytes_per_s: float | None = None
        self._rtt_samples: collections.deque[tuple[float, float]] = collections.deque()
        self._rate_samples: collections.deque[tuple[float, float]] = collections.deque()

    def fetched(self, now: float, latency_s: float, blocks: int) -> None:
        """A prefetch of `blocks` blocks took `latency_s`; one of a single block measures the RTT."""
        self.latency_s += RATE_SMOOTHING * (latency_s - self.latency_s)
        if blocks == 1:
            self._rtt_samples.append((now, latency_s))

    def delivered(self, now: float, bytes_per_s: float) -> None:
        """The bytes per second fetched from the hub since the last call (demand fetches too)."""
        if bytes_per_s > 0:
            self._rate_samples.append((now, bytes_per_s))
        for samples in (self._rate_samples, self._rtt_samples):
            while samples and samples[0][0] < now - LINK_WINDOW_S:
                samples.popleft()
        if not self._rate_samples or not self._rtt_samples:
            return
        self.bytes_per_s = max(rate for _t, rate in self._rate_samples)
        self.rtt_s = min(rtt for _t, rtt in self._rtt_samples)
        wanted = 2 * self.bytes_per_s * self.rtt_s / self._block_size + 1
        self.concurrency_blocks = max(MIN_CONCURRENCY_BLOCKS, min(self._slots, math.ceil(wanted)))
