"""`make_app(config)`: the hub's aiohttp application, with its routes, middlewares, state and cleanup."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

from aiohttp import web

from hubserver import batch, checksums, handlers, middlewares, rescan
from hubserver.auth import HubAuth
from hubserver.config import HubConfig
from hubserver.handlers import MANIFEST_CHUNK_BYTES_KEY, METRICS_KEY
from hubserver.metrics import (
    ENDPOINT_BATCH,
    ENDPOINT_CHECKSUMS,
    ENDPOINT_FILES,
    ENDPOINT_HEALTHZ,
    ENDPOINT_MANIFEST,
    ENDPOINT_METRICS,
    ENDPOINT_RESCAN,
    HubMetrics,
)
from hubserver.rescan import SNAPSHOT_KEY
from hubserver.scan import scan

log = logging.getLogger(__name__)

CONFIG_KEY: Final = web.AppKey("config", HubConfig)
AUTH_KEY: Final = web.AppKey("auth", HubAuth)

__all__ = ["AUTH_KEY", "CONFIG_KEY", "METRICS_KEY", "SNAPSHOT_KEY", "make_app"]


async def _snapshot_ctx(app: web.Application) -> AsyncIterator[None]:
    """Scan the root once, at startup, in a worker thread."""
    config = app[CONFIG_KEY]
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    snapshot = await loop.run_in_executor(None, scan, config.root)
    scan_s = time.monotonic() - started
    app[SNAPSHOT_KEY] = rescan.SnapshotHolder(snapshot, app[METRICS_KEY], config.root)
    rescan.publish(app[METRICS_KEY], snapshot, scan_s)
    log.info(
        "scanned %s: %d files, %d bytes, %d entries, generation %s (%.2f s)",
        snapshot.root,
        snapshot.file_count,
        snapshot.total_bytes,
        snapshot.entry_count,
        snapshot.generation,
        scan_s,
    )
    del snapshot  # suspended here for the hub's life: a rescan must be able to free this one
    async for _ in rescan.interval_ctx(app, config.rescan_interval_s):
        yield


async def _close_checksums(app: web.Application) -> None:
    app[checksums.CHECKSUMS_KEY].close()


def make_app(config: HubConfig, auth: HubAuth | None = None) -> web.Application:
    """Build the hub application; the root is scanned when it starts.

    `auth` defaults to the token files named in `config` (loaded now;
    raises TokenFileError).
    """
    if auth is None:
        auth = HubAuth.from_config(config)
    metrics = HubMetrics()
    app = web.Application(
        middlewares=middlewares.chain(metrics, auth, config.access_log),
        client_max_size=config.client_max_size_bytes,
    )
    app[CONFIG_KEY] = config
    app[AUTH_KEY] = auth
    app[METRICS_KEY] = metrics
    app[MANIFEST_CHUNK_BYTES_KEY] = config.manifest_chunk_bytes
    app.cleanup_ctx.append(_snapshot_ctx)
    app.on_response_prepare.append(handlers.set_server_header)
    add_get: Callable[..., web.AbstractRoute] = app.router.add_get
    add_get("/healthz", handlers.healthz, name=ENDPOINT_HEALTHZ)
    # No HEAD for the manifest: it would build and compress it for nothing.
    add_get("/v1/manifest", handlers.manifest, allow_head=False, name=ENDPOINT_MANIFEST)
    add_get("/v1/files/{file_id}", checksums.file_data, name=ENDPOINT_FILES)
    app[checksums.CHECKSUMS_KEY] = checksums.ChecksumCache(on_hashed=metrics.count_hashed)
    app.on_cleanup.append(_close_checksums)
    add_get("/v1/files/{file_id}/checksums", checksums.file_checksums, allow_head=False, name=ENDPOINT_CHECKSUMS)
    app[batch.SLOTS_KEY] = batch.BatchSlots(on_hashed=metrics.count_hashed)
    add_get("/v1/batch", batch.batch, allow_head=False, name=ENDPOINT_BATCH)
    add_get("/metrics", handlers.metrics, name=ENDPOINT_METRICS)
    app.router.add_post("/v1/rescan", handlers.rescan, name=ENDPOINT_RESCAN)
    return app
