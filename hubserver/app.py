"""The hub's aiohttp application: routes, middlewares, snapshot lifecycle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

from aiohttp import web

from hubserver import handlers
from hubserver.config import HubConfig
from hubserver.handlers import MANIFEST_CHUNK_BYTES_KEY, SNAPSHOT_KEY
from hubserver.manifest import scan

LOG = logging.getLogger(__name__)

CONFIG_KEY: Final = web.AppKey("config", HubConfig)

__all__ = ["CONFIG_KEY", "SNAPSHOT_KEY", "make_app"]


async def _snapshot_ctx(app: web.Application) -> AsyncIterator[None]:
    """Scan the root once, at startup, in a worker thread."""
    config = app[CONFIG_KEY]
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    snapshot = await loop.run_in_executor(None, scan, config.root)
    app[SNAPSHOT_KEY] = snapshot
    LOG.info(
        "scanned %s: %d files, %d bytes, %d entries, generation %s (%.2f s)",
        snapshot.root,
        snapshot.file_count,
        snapshot.total_bytes,
        len(snapshot.entries),
        snapshot.generation,
        time.monotonic() - started,
    )
    yield


def make_app(config: HubConfig) -> web.Application:
    """Build the hub application; the root is scanned when it starts."""
    app = web.Application(
        middlewares=[handlers.error_middleware],
        client_max_size=config.client_max_size_bytes,
    )
    app[CONFIG_KEY] = config
    app[MANIFEST_CHUNK_BYTES_KEY] = config.manifest_chunk_bytes
    app.cleanup_ctx.append(_snapshot_ctx)
    app.on_response_prepare.append(handlers.restore_snapshot_etag)
    add_get: Callable[..., web.AbstractRoute] = app.router.add_get
    add_get("/healthz", handlers.healthz)
    # No HEAD for the manifest: it would build and compress it for nothing.
    add_get("/v1/manifest", handlers.manifest, allow_head=False)
    add_get("/v1/files/{file_id}", handlers.file_data)
    return app
