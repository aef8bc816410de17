"""Which snapshot the mount shows: the manifest at mount time, and moving to a new generation.

A mount shows one generation of the hub's tree. `refresh` moves it to the
hub's current one: the new manifest replaces the namespace in one LMDB
transaction; the kernel is told to forget the attributes, names and page
cache of what changed; cached blocks of changed or removed files are
dropped (unchanged files keep theirs, since blocks are keyed by version;
versions still open keep theirs until the next mount). Files already open
keep reading the version they opened: its cached blocks still serve,
uncached ones fail with ESTALE (the hub answers 412), never a mix of
versions.
"""

from __future__ import annotations

import gzip
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lmdb
import trio

from ..cache import BlockCache
from ..config import MountConfig
from ..db import NamespaceDb, put_meta
from ..errors import CachefsError, HubError, HubProtocolError, HubStatusError, HubUnavailable
from ..fetch.hub_client import HubClient, parse_json
from .loader import ChildFailed, load_in_child
from .tree import Changes, ManifestSummary, Namespace, load_manifest

log = logging.getLogger(__name__)

Invalidate = Callable[[Changes], Awaitable[None]]

# A manifest this large (gzipped; ~30 bytes an entry, so ~35,000 entries) is
# loaded in a child process: LMDB would keep ~200 bytes an entry in the daemon.
LOAD_IN_CHILD_MIN_BYTES = 1 << 20
# The manifest's download may last 60 s, plus 1 s per 25 kB received (gzipped,
# ~200 kbit/s): an ImageNet-sized one (~35 MB) over a slow link arrives, a hub
# that trickles is given up.
MANIFEST_GRACE_S = 60.0
MANIFEST_MIN_BYTES_PER_S = 25_000
# File versions whose cached blocks are dropped per batch (one unlink each).
DROP_BATCH_VERSIONS = 500


class Snapshots:
    """Loads manifests into the namespace and keeps the cache consistent with them."""

    def __init__(
        self,
        config: MountConfig,
        client: HubClient,
        db: NamespaceDb,
        namespace: Namespace,
        open_versions: Callable[[], set[tuple[bytes, bytes]]] = set,
    ) -> None:
        self._config = config
        self._client = client
        self._db = db
        self._namespace = namespace
        self._manifest_path = config.cache_dir / "tmp" / "manifest.ndjson.gz"
        self._lock = trio.Lock()
        # (file id, version) of the files open now: their cached blocks are kept
        self._open_versions = open_versions

    async def load_at_mount(self) -> bool:
        """Load the hub's manifest if it is new; offline, keep the stored one (if any).

        With a snapshot stored, a new manifest that has not arrived within
        the config's manifest_wait_s is given up for now: returns True, and
        the caller loads it once mounted (a refresh).
        """
        stored = self._namespace.summary()
        try:
            generation = await self._download(stored.generation if stored else None,
                                              self._config.manifest_wait_s if stored else math.inf)
        except (CachefsError, trio.TooSlowError) as exc:  # the hub, or no room for its manifest
            reason = str(exc) or f"not complete within {self._config.manifest_wait_s:g} s"
            if isinstance(exc, HubStatusError) and exc.status in (401, 403):
                # Refused, not unreachable: no offline mount on a token or certificate the hub turned down.
                raise HubError(f"hub {self._config.hub_url} refused this spoke ({reason}): check its token "
                               "or client certificate") from None
            if stored is None:
                if isinstance(exc, CachefsError) and not isinstance(exc, HubError):
                    raise
                raise HubError(f"cannot get the manifest from hub {self._config.hub_url}: {reason}") from None
            behind = isinstance(exc, trio.TooSlowError)
            log.warning("no new manifest from hub %s (%s); serving the cached snapshot %s%s", self._config.hub_url,
                        reason, stored.generation, "; loading the new one once mounted" if behind else " offline")
            return behind
        if generation is not None:
            _summary, changes = await self._load()
            changes.discard()  # the kernel knows nothing of this mount yet
            put_meta(self._db, "hub_url", str(self._config.hub_url))
        return False

    async def refresh(self, cache: BlockCache, invalidate: Invalidate, moved: Callable[[str], None],
                      telling_kernel: Callable[[], AbstractContextManager[object]]) -> dict[str, Any]:
        """Move to the hub's current generation; a no-op if it is the one shown.

        `moved` gets the new generation as soon as it is loaded, before the
        kernel is told: what was resolved against the old one ends there
        (plans; a plan that started arriving once the new one was shown is kept).
        `telling_kernel` is entered from before the load until `invalidate` is done:
        meanwhile the kernel may still hold what changed.
        """
        async with self._lock:
            old = self._namespace.summary()
            generation = await self._download(old.generation if old else None)
            if generation is None:
                return {"generation": old.generation if old else None, "changed": False}
            with telling_kernel():
                summary, changes = await self._load()
                try:
                    moved(summary.generation)
                    await invalidate(changes)
                finally:
                    changes.discard()
            dropped = await self._drop_stale(cache, summary.generation)
            log.info("moved from generation %s to %s: %d entries changed, %d removed, %d cached blocks dropped",
                     old.generation if old else None, summary.generation, len(changes.changed), len(changes.removed), dropped)
            return {
                "previous_generation": old.generation if old else None,
                "generation": summary.generation,
                "changed": True,
                "changed_entries": len(changes.changed),
                "removed_entries": len(changes.removed),
                "dropped_blocks": dropped,
            }

    async def drop_stale_blocks(self, cache: BlockCache) -> None:
        """Drop cached blocks of file versions the snapshot shown no longer has, unless that was
        done for it (background task at mount: a new manifest loaded at mount, or a refresh cut
        short by an unmount, leaves them; they would never be read, but take cache space)."""
        async with self._lock:
            summary = self._namespace.summary()
            if summary is None or cache.stale_checked_for() == summary.generation:
                return
            try:
                dropped = await self._drop_stale(cache, summary.generation)
            except (OSError, lmdb.Error) as exc:
                log.warning("cannot drop the cached blocks of older versions: %s", exc)
                return
            log.info("dropped %d cached blocks of file versions generation %s no longer has", dropped,
                     summary.generation)

    async def _drop_stale(self, cache: BlockCache, generation: str) -> int:
        """Drop the cached blocks of file versions the snapshot no longer has; returns how many.

        Versions still open keep theirs (the handle keeps reading what is
        cached of its version) until the next mount. A batch of versions at
        a time, each in one index transaction and its
        own thread call: the cache writer waits for the cache's lock one batch
        at most (a data file's unlink each: 150,000 took 12.5 s here), and an
        unmount ends it between batches; what is left is dropped at the next
        mount (`generation` is recorded only once all are gone).
        """
        unpinned, resized = await trio.to_thread.run_sync(cache.repin, self._namespace.file_size)
        if unpinned or resized:
            log.info("pins brought to generation %s: %d files it no longer has unpinned, %d resized",
                     generation, unpinned, resized)
        stale = await trio.to_thread.run_sync(cache.stale_versions, self._namespace.file_version)
        in_use = self._open_versions()
        versions = [keys for keys in stale if (keys[0].file_id, keys[0].version) not in in_use]
        for start in range(0, len(versions), DROP_BATCH_VERSIONS):
            await trio.to_thread.run_sync(cache.drop_versions, versions[start : start + DROP_BATCH_VERSIONS])
        if len(versions) == len(stale):
            await trio.to_thread.run_sync(cache.mark_stale_checked, generation)
        else:  # dropped at the next mount
            log.info("kept the cached blocks of %d older file versions still open", len(stale) - len(versions))
        return sum(len(keys) for keys in versions)

    async def poll(self, interval_s: float, refresh: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Call `refresh` whenever the hub's generation differs (background task)."""
        while True:
            await trio.sleep(interval_s)
            try:
                with trio.fail_after(self._config.fetch_timeout_s):
                    health = await self._client.healthz()
                summary = self._namespace.summary()
                if summary is not None and health.get("generation") != summary.generation:
                    await refresh()
            except HubError as exc:
                log.info("generation poll failed: %s", exc)
            except trio.TooSlowError:
                log.info("generation poll failed: timed out")
            except (CachefsError, OSError, lmdb.Error) as exc:  # e.g. no room: the mount stays on its generation
                log.warning("cannot move to the hub's new generation: %s; will try again", exc)

    async def _download(self, known_generation: str | None, wait_s: float = math.inf) -> str | None:
        """Save the manifest to disk; None if its generation is `known_generation`.
        Raises CachefsError if it cannot be stored, trio.TooSlowError after `wait_s`;
        on any failure what was written is removed."""
        saved = False
        try:
            self._manifest_path.parent.mkdir(mode=0o700, exist_ok=True)
            with trio.fail_after(wait_s):
                generation = await download_manifest(self._client, self._manifest_path, known_generation)
            saved = True
            return generation
        except OSError as exc:
            raise CachefsError(f"cannot store the hub's manifest in {self._manifest_path.parent}: "
                               f"{exc.strerror or exc}") from None
        finally:
            if not saved:
                self._manifest_path.unlink(missing_ok=True)

    def _stored_generation(self) -> str | None:
        summary = self._namespace.summary()
        return summary.generation if summary is not None else None

    async def _load(self) -> tuple[ManifestSummary, Changes]:
        """Load the downloaded manifest into the namespace (one transaction: all or nothing).

        A large manifest is loaded in a child process, so that the memory the
        load takes leaves with it (namespace/loader.py); a small one, here in a
        thread (a child costs ~0.2-0.4 s to start). The downloaded manifest is
        removed once loaded, or when the load fails or is cancelled.
        """
        try:
            if self._manifest_path.stat().st_size >= LOAD_IN_CHILD_MIN_BYTES:
                try:
                    return await load_in_child(Path(self._db.env.path()), self._manifest_path, self._stored_generation)
                except ChildFailed as exc:  # e.g. an interpreter that cannot run -m: load it here
                    log.warning("%s; loading the manifest in the daemon instead", exc)
            return await trio.to_thread.run_sync(load_manifest, self._db, self._manifest_path)
        except (OSError, lmdb.Error) as exc:
            raise CachefsError(f"cannot load the hub's manifest into {self._config.cache_dir}: {exc}") from None
        finally:
            self._manifest_path.unlink(missing_ok=True)


async def download_manifest(
    client: HubClient,
    path: Path,
    known_generation: str | None,
    grace_s: float = MANIFEST_GRACE_S,
    min_bytes_per_s: float = MANIFEST_MIN_BYTES_PER_S,
) -> str | None:
    """Save the hub's manifest gzipped at `path`; None (nothing saved) if its generation is `known_generation`.

    It may take as long as it keeps coming: `grace_s`, plus 1 s per
    `min_bytes_per_s` received (gzipped, as sent: a stream that inflates
    1000-fold buys no time), and the client's read timeout when nothing
    arrives. Raises HubUnavailable when it falls behind, HubProtocolError
    for a header without a generation or more entries than it announced.
    """
    started = trio.current_time()
    received = [0]

    def on_received(wire_bytes: int) -> None:
        received[0] += wire_bytes
        scope.deadline = started + grace_s + received[0] / min_bytes_per_s

    with trio.CancelScope(deadline=started + grace_s) as scope:
        lines = client.manifest_lines(on_received)
        try:
            first_line = await lines.__anext__()
            header = parse_json(first_line)
            generation, announced = header.get("generation"), header.get("entries")
            if not isinstance(generation, str):
                raise HubProtocolError("the hub's manifest header has no generation")
            if generation == known_generation:
                log.info("manifest generation %s is already loaded", known_generation)
                return None
            await _save_lines(lines, first_line, path, announced if isinstance(announced, int) else None)
        except StopAsyncIteration:
            raise HubError("the hub sent an empty manifest") from None
        finally:
            await lines.aclose()
        return generation
    raise HubUnavailable(
        f"the hub's manifest came too slowly: {received[0]} bytes in {trio.current_time() - started:.1f} s "
        f"(after the first {grace_s:.0f} s it must average {min_bytes_per_s / 1000:.0f} kB/s gzipped)"
    )


async def _save_lines(lines: AsyncIterator[bytes], first_line: bytes, path: Path, announced: int | None) -> None:
    """Write the header line and the entry lines to `path`, gzipped; at most `announced` entries."""
    count = 0
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(first_line + b"\n")
        async for line in lines:
            count += 1
            if announced is not None and count > announced:
                raise HubProtocolError(f"the hub's manifest has more entries than the {announced} its header announced")
            out.write(line + b"\n")
