"""Fetch blocks from the hub: single-flight, bounded retries, then into the cache.

Concurrent misses of one block share one request. A fetch retries
connection failures, timeouts, truncated bodies and 5xx answers with
exponential backoff and jitter until `fetch_timeout_s` has passed, then
fails; it never waits longer than that.
"""

from __future__ import annotations

import logging
import random

import trio

from .cache import BlockCache, BlockKey
from .errors import HubError, HubProtocolError, HubStatusError, HubUnavailable, RemoteFileChanged
from .hub_client import HubClient
from .metrics import Stats

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class _Flight:
    """One block being fetched; followers wait on `done`."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.error: HubError | None = None


class Fetcher:
    """Gets blocks from the hub and stores them in the cache."""

    def __init__(self, client: HubClient, cache: BlockCache, stats: Stats, fetch_timeout_s: float) -> None:
        self._client = client
        self._cache = cache
        self._stats = stats
        self._fetch_timeout_s = fetch_timeout_s
        self._flights: dict[BlockKey, _Flight] = {}

    def in_flight(self, key: BlockKey) -> bool:
        return key in self._flights

    async def fetch(self, key: BlockKey, start: int, length: int) -> bytes:
        """The block's bytes from the hub (raises HubError when it cannot be had in time)."""
        flight = self._flights.get(key)
        if flight is not None:
            await flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.data is not None
            return flight.data
        flight = self._flights[key] = _Flight()
        try:
            flight.data = await self._fetch_with_retries(key, start, length)
            await trio.to_thread.run_sync(self._cache.insert, key, flight.data)
            return flight.data
        except HubError as exc:
            flight.error = exc
            raise
        except BaseException:
            flight.error = HubUnavailable(f"fetch of {key} was cancelled")
            raise
        finally:
            del self._flights[key]
            flight.done.set()

    async def _fetch_with_retries(self, key: BlockKey, start: int, length: int) -> bytes:
        deadline = trio.current_time() + self._fetch_timeout_s
        backoff_s = FIRST_BACKOFF_S
        attempt = 0
        while True:
            attempt += 1
            try:
                with trio.fail_after(max(0.0, deadline - trio.current_time())):
                    data = await self._client.get_range(key.file_id.hex(), key.version.hex(), start, length)
                self._stats.fetches += 1
                self._stats.fetched_bytes += len(data)
                return data
            except trio.TooSlowError:
                error: HubError = HubUnavailable(f"hub did not deliver {key} within {self._fetch_timeout_s:g} s")
            except (HubUnavailable, HubProtocolError) as exc:
                error = exc
            except RemoteFileChanged:
                self._stats.fetch_failures += 1
                raise
            except HubStatusError as exc:
                if not exc.retryable:
                    self._stats.fetch_failures += 1
                    raise
                error = exc
            pause_s = random.uniform(0, backoff_s)  # full jitter
            if trio.current_time() + pause_s >= deadline:
                log.warning("giving up on %s after %d attempts: %s", key, attempt, error)
                self._stats.fetch_failures += 1
                raise error
            log.info("fetching %s failed (%s); retry %d in %.2f s", key, error, attempt, pause_s)
            self._stats.fetch_retries += 1
            await trio.sleep(pause_s)
            backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
